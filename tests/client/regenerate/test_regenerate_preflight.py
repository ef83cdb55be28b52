"""Issue 36.7: the README's `hsx regenerate ... --seed 1` against a CPU server had every
request refused (`seed is not available on vLLM's CPU backend`), exited 1 with an empty
output, summarized only `15 failed {'invalid_request': 15}`, and locked the refused settings
into the plan (a retry needed a new --output). Now a pre-flight request (max_tokens 1, the
run's settings) refuses such settings in one line before any work; the summary names each
failure reason with an example; a run that stored nothing binds no settings. Without an
engine: the real run, journal and client against an in-process endpoint (the engine test
is tests/e2e/test_regenerate_e2e.py)."""

from __future__ import annotations

import asyncio
import json

import httpx

from hsx_client.regenerate.cli import summary_line
from hsx_client.regenerate.journal import work_dir
from hsx.exit_codes import ExitCode
from hsx_client.regenerate.run import RegenConfig, run_regenerate
from hsx_client.regenerate.turns import Sampling
from hsx_client.settings import ClientSettings

SEED_REFUSED = "seed is not available on vLLM's CPU backend"


class CpuEndpoint:
    """/v1/chat/completions as hsx serve on vLLM CPU answers it: a seeded request is a 400;
    `failing` questions get a 422 (the pre-flight's "Hello" never does)."""

    def __init__(self, failing: bool = False, max_model_len: int | None = None):
        self.failing = failing
        self.max_model_len = max_model_len  # None: no /v1/models (404), as a server without the route
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/info":
            return httpx.Response(200, json={"model": "fake/chat"})
        if request.url.path == "/v1/models":
            if self.max_model_len is None:
                return httpx.Response(404, json={"error": {"type": "not_found", "message": "no route"}})
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "fake/chat", "object": "model", "max_model_len": self.max_model_len}]})
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        self.bodies.append(body)
        if "seed" in body:
            return httpx.Response(400, json={"error": {"type": "invalid_request", "message": SEED_REFUSED}})
        question = body["messages"][0]["content"]
        if self.failing and question != "Hello":
            return httpx.Response(422, json={"error": {"type": "unlucky", "message": f"not {question}"}})
        return httpx.Response(200, json={"prompt_token_ids": [1, 2], "choices": [{
            "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "token_ids": [5, 2]}]})


def _inputs(tmp_path, n=5):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": "a"}]}) + "\n"
                            for i in range(n)))
    return path


def _run(inputs, out, endpoint, **sampling):
    cfg = RegenConfig(client=ClientSettings.given(["http://fake"], max_attempts=1), inputs=[str(inputs)], output=out,
                      sampling=Sampling(**sampling), quiet=True, transport=httpx.MockTransport(endpoint))
    return asyncio.run(run_regenerate(cfg))


def test_settings_the_server_refuses_are_refused_in_one_line_before_any_work(tmp_path):
    inputs, out = _inputs(tmp_path), tmp_path / "regen.jsonl"
    cpu = CpuEndpoint()
    refused = _run(inputs, out, cpu, seed=1, temperature=0.6)
    assert refused.exit_code == ExitCode.REFUSED, refused.summary
    error = refused.summary["error"]
    assert "\n" not in error and SEED_REFUSED in error and "--seed 1" in error, error
    assert "planned" not in refused.summary  # the CLI prints this one line, no summary
    assert len(cpu.bodies) == 1 and cpu.bodies[0]["max_tokens"] == 1  # only the pre-flight was asked
    assert not out.exists() and not (work_dir(out) / "plan.json").exists()
    again = _run(inputs, out, cpu, temperature=0.6)  # the same --output, without --seed
    assert again.exit_code == ExitCode.OK and again.summary["in_output"]["rows"] == 5, again.summary


def test_a_run_that_stored_nothing_binds_no_settings_and_names_each_failure(tmp_path):
    inputs, out = _inputs(tmp_path), tmp_path / "regen.jsonl"
    failed = _run(inputs, out, CpuEndpoint(failing=True), temperature=0.6)
    assert failed.exit_code == ExitCode.FAILED and failed.summary["failed"] == 5, failed.summary
    line = summary_line(failed.summary)
    assert "; 5 failed (unlucky 5, e.g. chats.jsonl:" in line and ": not q" in line, line
    retry = _run(inputs, out, CpuEndpoint(), temperature=0.2)  # other settings into the same --output
    assert retry.exit_code == ExitCode.OK, retry.summary
    assert json.loads((work_dir(out) / "plan.json").read_text())["sampling"]["temperature"] == 0.2
    third = _run(inputs, out, CpuEndpoint(), temperature=0.9)  # now rows are stored: bound
    assert third.exit_code == ExitCode.REFUSED and "other settings" in third.summary["error"], third.summary


def test_max_tokens_past_the_servers_context_is_refused_in_one_line_before_any_work(tmp_path):
    """The README's `--max-tokens 2048` against stories260K (max_model_len 512): every
    conversation was dropped for a full context, 0 rows, and its --extract-to step failed on
    the empty output. The pre-flight reads max_model_len from /v1/models and refuses it."""
    inputs, out = _inputs(tmp_path), tmp_path / "regen.jsonl"
    cpu = CpuEndpoint(max_model_len=512)
    refused = _run(inputs, out, cpu, max_tokens=2048, temperature=0.6)
    assert refused.exit_code == ExitCode.REFUSED, refused.summary
    error = refused.summary["error"]
    assert "\n" not in error and "--max-tokens 2048" in error and "512" in error, error
    assert cpu.bodies == [] and not out.exists() and not (work_dir(out) / "plan.json").exists()
    fits = _run(inputs, out, cpu, max_tokens=256, temperature=0.6)  # below the context: the same --output runs
    assert fits.exit_code == ExitCode.OK and fits.summary["in_output"]["rows"] == 5, fits.summary


def test_a_server_without_v1_models_is_not_refused_for_max_tokens(tmp_path):
    inputs, out = _inputs(tmp_path), tmp_path / "regen.jsonl"
    done = _run(inputs, out, CpuEndpoint(), max_tokens=2048, temperature=0.6)
    assert done.exit_code == ExitCode.OK and done.summary["in_output"]["rows"] == 5, done.summary
