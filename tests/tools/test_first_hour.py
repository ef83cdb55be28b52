"""Issue 10 ("first hour with hsx") without an engine: install names, the README, the
pre-flight against /info, defaults from the servers, drops and cuts, exit codes and
reasons, noise, the disk estimate. One-line refusals and fail-fast:
tests/tools/test_one_line_refusals.py; the same against a real server: tests/e2e/test_first_hour_e2e.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tomllib

import httpx
import numpy as np
import pytest
from _first_hour import H, L, EagleFormat, InfoServer, refused_and_untouched, run
from _extract_fakes import N, FakeFormat, cfg_for, data, hooks  # noqa: F401  (data: a fixture)

from _server import CHAT, REPO
from hsx import wire
from hsx_client.corpus import extract as ex
from hsx_client.corpus import journal, store
from hsx_client.corpus.inputs import read_samples
from hsx_client.corpus.progress import Progress
from hsx_client.corpus.verify import verify_corpus


# ------------------------------------------------------------------ install names (issue 10.1, 10.9)
def test_distribution_name_is_free_of_the_unrelated_hsx_and_the_license_is_spdx():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "hsx-hidden-states"
    assert meta["project"]["license"] == "Apache-2.0" and meta["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])
    assert meta["project"]["scripts"] == {"hsx": "hsx_tools.cli:main"}
    for extra in ("cpu", "gpu"):
        assert "hsx-hidden-states[serve]" in meta["project"]["optional-dependencies"][extra]
    docs = [REPO / "README.md", REPO / "Dockerfile", *(REPO / "docs").rglob("*.md"), *(REPO / "scripts").glob("*"),
            *(REPO / "deploy").rglob("*.*"), *(REPO / "hsx").rglob("*.py"), *(REPO / "tools").rglob("*.py"), *(REPO / "client").rglob("*.py"),
            *(REPO / "service").rglob("*.py")]
    for p in docs:
        text = p.read_text(errors="replace")
        wrong = re.findall(r"pip3? install[^\n`]*?[\s'\"]hsx(?:\[|[\s'\"`]|$)", text)
        assert not wrong, f"{p}: {wrong} installs PyPI's unrelated `hsx`"
    assert "pip install 'hsx-hidden-states[cpu]'" in (REPO / "README.md").read_text()


@pytest.mark.slow
def test_building_the_wheel_gives_no_setuptools_license_warnings(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), "-v", str(REPO)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "project.license" not in log and "License classifiers are deprecated" not in log, log[-3000:]
    assert list(tmp_path.glob("hsx_hidden_states-*.whl"))


# ------------------------------------------------------------------ README (issue 10.8)
def readme_snippet() -> str:
    text = (REPO / "README.md").read_text()
    after = text.split("From your own asyncio code", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # worker processes / a fresh interpreter: seconds each
def test_readme_snippet_is_a_script_that_fails_within_seconds_against_a_dead_url(tmp_path):
    from _client_fakes import dead_url

    code = readme_snippet()
    compile(code, "README.md", "exec")  # `async with` at top level was a SyntaxError
    assert "asyncio.run(main())" in code
    script = tmp_path / "snippet.py"
    script.write_text(code.replace("http://localhost:8001", dead_url()))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 1 and "ServersUnreachableError" in r.stderr and "no server answered" in r.stderr, r.stderr
    assert "ConnectError" in r.stderr
    assert took < 30, f"{took:.0f} s against a dead URL (was 126 s)"  # mostly the imports
    readme = (REPO / "README.md").read_text()
    assert "VLLM_CPU_KVCACHE_SPACE" in readme


def test_demo_hint_names_no_port_of_the_server_it_stopped():
    src = (REPO / "tools" / "demo.py").read_text()
    assert "{server.url}/hidden_states" not in src and "hsx serve {model}" in src


@pytest.mark.parametrize("argv, port", [([], None), (["--port", "8123"], 8123)])
def test_demo_serves_on_the_port_asked_or_a_free_one(tmp_path, monkeypatch, argv, port):
    """Issue 36.9: `hsx demo` had no --port. The server stand-in records its port and fails
    to start, so no engine runs."""
    from hsx_tools import demo, server_process

    started = []

    class NoServer:
        def __init__(self, model, *args, log_path, env=None, port=None):
            started.append(port)
            self.cmd = ["python", "-m", "hsx", model, *args]

        def wait_ready(self, timeout):
            raise server_process.ServerStartError("stand-in: no engine here")

        def stop(self, timeout=60):
            return 0

    monkeypatch.setattr(server_process, "ServerProcess", NoServer)
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text("{}")  # the model is there: none is made
    with pytest.raises(SystemExit, match="stand-in"):
        demo.main(["--workdir", str(tmp_path), *argv])
    assert started == [port]
    for bad in ("0", "70000", "http"):
        with pytest.raises(SystemExit) as exc:
            demo.main(["--port", bad])
        assert exc.value.code == 2


def test_hsx_help_lists_every_tiny_model_family(capsys):
    """Issue 36.9: `hsx --help` listed the families by hand, without kimi_k25."""
    from hsx_tools.cli import main
    from hsx_tools.tiny_model import FAMILIES

    assert main(["--help"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "make-tiny-model" in x)
    assert line.endswith(f"({', '.join(FAMILIES)})") and "kimi_k25" in line


def test_demo_says_honestly_what_it_takes():
    from hsx_tools import demo

    assert "about a minute" not in demo.__doc__ and "a few minutes on a small CPU box" in demo.__doc__


# ------------------------------------------------------------------ pre-flight (issue 10.2, lead 3)
def test_too_few_layers_for_eagle3_refused_before_any_sample(tmp_path, data):
    out = tmp_path / "new" / "out"
    srv = InfoServer(layer_ids=[2, 5], num_hidden_layers=5)  # the old default on the 5-layer fixture
    r = run(cfg_for(data, out, format="speculators"), EagleFormat(), srv)
    refused_and_untouched(r, out, srv, r"need 4 layers.*\[2, 5\].*restart hsx serve with --layers 1,2,3,5")
    assert not (tmp_path / "new").exists()  # the folders it would have made are gone too


def test_more_served_layers_than_eagle3_takes_names_the_layers_flag(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer(layer_ids=[0, 1, 2, 3, 4, 5, 6, 7, 8], num_hidden_layers=8)
    r = run(cfg_for(data, out, format="speculators"), EagleFormat(), srv)
    refused_and_untouched(r, out, srv, r"pass --layers 2,4,5,8")
    srv2 = InfoServer(layer_ids=[0, 1, 2, 3, 4, 5, 6, 7, 8], num_hidden_layers=8)
    r = run(cfg_for(data, out, format="speculators", layers=[2, 4, 5, 8]), EagleFormat(), srv2)
    assert r.exit_code == 0, r.summary
    assert all(b["layers"] == [2, 4, 5, 8] for b in srv2.bodies)


def test_a_two_layer_model_is_refused_for_eagle3(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer(layer_ids=[0, 1, 2], num_hidden_layers=2)
    refused_and_untouched(run(cfg_for(data, out), EagleFormat(), srv), out, srv, r"only 2 decoder layer")


def test_draft_vocab_size_outside_the_vocab_refused_before_the_run(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer(vocab_size=512)
    r = run(cfg_for(data, out, draft_vocab_size=32000), FakeFormat(), srv)
    refused_and_untouched(r, out, srv, r"--draft-vocab-size 32000 must be in 1\.\.512")


def test_layers_not_served_refused(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer()
    refused_and_untouched(run(cfg_for(data, out, layers=[1, 2, 3, 9]), FakeFormat(), srv), out, srv,
                          r"serves layers \[1, 2, 3, 4\], not \[9\]")


def test_max_length_over_a_servers_limit_refused(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer()
    srv.per_url["s2"] = {"max_tokens_per_request": 511}
    r = run(cfg_for(data, out, max_length=2048), FakeFormat(), srv)
    refused_and_untouched(r, out, srv, r"--max-length 2048 exceeds the 511 tokens http://s2 takes")


def test_chat_rows_on_a_server_without_a_chat_template_refused(tmp_path):
    p = tmp_path / "chats.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    out = tmp_path / "out"
    srv = InfoServer(chat_template_sha256=None)
    cfg = cfg_for(p, out)
    r = ex.run_extract(cfg, ex.Hooks(read_samples=read_samples, get_format=lambda n: FakeFormat(),
                                     make_context=hooks(None).make_context), transport=httpx.MockTransport(srv))
    refused_and_untouched(r, out, srv, r"1 planned sample\(s\) are chats and .* no chat template.*--chat-template")


def test_an_existing_empty_dir_is_left_as_it_was(tmp_path, data):
    out = tmp_path / "out"
    out.mkdir()
    srv = InfoServer(vocab_size=10)
    r = run(cfg_for(data, out, draft_vocab_size=64), FakeFormat(), srv)
    assert r.exit_code == 2 and out.is_dir() and not list(out.iterdir())  # no .lock left behind


# ------------------------------------------------------------------ defaults from the servers (10.3, lead 4)
def test_max_length_defaults_to_the_smallest_server_limit_and_is_recorded(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer()
    srv.per_url["s2"] = {"max_tokens_per_request": 1000}
    srv.long = {0, 1}
    r = run(cfg_for(data, out), FakeFormat(), srv)
    assert r.exit_code == 0, r.summary
    plan = json.loads((out / "plan.json").read_text())
    assert plan["settings"]["max_length"] == 1000 and plan["settings"]["truncation"] == "right"
    assert {(b["max_length"], b["truncation"], b["require_supervised"]) for b in srv.bodies} == {(1000, "right", True)}
    assert r.summary["truncated"] == 2 and r.summary["max_length"] == 1000
    text = ex.format_summary(r.summary)
    assert "cut: 2 stored sample(s) were longer than --max-length 1000" in text
    assert json.loads((out / "hsx_corpus.json").read_text())["counts"]["truncated"] == 2
    # a resume without flags takes the plan's value
    assert run(cfg_for(data, out), FakeFormat(), srv).exit_code == 0


# ------------------------------------------------------------------ drops (10.4)
def test_rows_without_a_supervised_token_are_dropped_counted_and_not_failures(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), InfoServer()
    srv.empty_mask = {2, 5, 7}
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 0 and r.status == "complete", r.summary
    assert r.summary["dropped"] == 3 and r.summary["failed"] == 0 and r.summary["done"] == N - 3
    (reason,) = r.summary["dropped_reasons"]
    assert reason["count"] == 3 and "no supervised token" in reason["reason"]
    text = ex.format_summary(r.summary)
    assert "dropped: 3 x 422 no_supervised_tokens: no supervised token after right truncation" in text
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert corpus["counts"]["dropped"] == 3 and corpus["counts"]["failed"] == 0 and len(corpus["dropped_indices"]) == 3
    rep = verify_corpus(out, lambda name: fmt)
    assert rep["ok"] and rep["dropped"] == 3, rep
    srv.requests.clear()
    r = run(cfg_for(data, out, retry_failed=True), fmt, srv)  # policy, not failure: never retried
    assert r.exit_code == 0 and not srv.requests


def test_a_response_with_an_all_zero_mask_is_dropped_by_the_client_too(tmp_path, data):
    """A server that does not know require_supervised: the client drops the row itself."""
    out = tmp_path / "out"

    class ZeroMask(InfoServer):
        def __call__(self, request):
            if request.url.path != "/hidden_states":
                return super().__call__(request)
            body = json.loads(request.content)
            self.bodies.append(body)
            ids = body["input_ids"]
            t = len(ids)
            specs = [wire.TensorSpec("hidden_states", "F32", (t, L, H)), wire.TensorSpec("token_ids", "I64", (t,)),
                     wire.TensorSpec("loss_mask", "U8", (t,))]
            mask = np.zeros(t, np.uint8) if ids[0] == 4 else np.ones(t, np.uint8)
            data = (wire.encode_header(specs, {"layer_ids": "[1,2,3,4]"}) + np.zeros((t, L, H), np.float32).tobytes()
                    + np.asarray(ids, np.int64).tobytes() + mask.tobytes())
            return httpx.Response(200, content=data, headers={"Content-Type": wire.MEDIA_TYPE})

    r = run(cfg_for(data, out), FakeFormat(), ZeroMask())
    assert r.exit_code == 0 and r.summary["dropped"] == 1 and r.summary["done"] == N - 1, r.summary


# ------------------------------------------------------------------ exit status, reasons, bad rows (10.5, 11 Also)
def test_bad_rows_are_listed_with_file_and_line_in_the_summary_and_in_dir(tmp_path, data):
    out = tmp_path / "out"
    r = run(cfg_for(data, out), FakeFormat(), InfoServer())
    assert r.exit_code == 0 and r.summary["bad_rows"] == 1
    rows, _, _ = journal.read_jsonl(out / store.BAD_ROWS_NAME)
    assert rows == [{"source": f"{data}:{N + 1}", "kind": "malformed", "reason": "no input_ids"}]
    text = ex.format_summary(r.summary)
    assert f"bad input rows: 1 skipped (1 malformed); listed in {out / store.BAD_ROWS_NAME}" in text
    assert f"  {data}:{N + 1}: no input_ids" in text


@pytest.mark.slow  # > 2 s without an engine
def test_mt_bench_questions_alone_say_why_no_row_is_usable(tmp_path):
    q = CHAT / "mt_bench" / "question.jsonl"
    if not q.exists():
        pytest.skip("needs ../shared/fixtures")
    from hsx_client.corpus import cli

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "hsx_tools.cli", "extract", "--server", "http://127.0.0.1:9", "--input",
                        str(q), "--output", str(out), "--format", "speculators"], capture_output=True, text=True,
                       timeout=120)
    assert cli  # the parser module exists (for the epilog test below)
    # The servers come first (nothing listens here): the message is about them, in seconds.
    assert r.returncode == 1 and "no server answered" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # With a server, the input is the problem: refused before any plan is written.
    srv = InfoServer(chat_template_sha256="abc")
    cfg = cfg_for(q, out, format="speculators")
    res = ex.run_extract(cfg, ex.Hooks(read_samples=read_samples, get_format=lambda n: FakeFormat(),
                                       make_context=hooks(None).make_context), transport=httpx.MockTransport(srv))
    assert res.exit_code == 2, res.summary
    assert res.summary["message"].startswith(
        "no usable rows in question.jsonl: 80 rows have no assistant turn (questions only; pair them with answers")
    assert not out.exists() and not srv.bodies


def test_empty_input_says_no_usable_rows(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    out = tmp_path / "out"
    srv = InfoServer()
    r = ex.run_extract(cfg_for(p, out), ex.Hooks(read_samples=read_samples, get_format=lambda n: FakeFormat(),
                                                 make_context=hooks(None).make_context),
                       transport=httpx.MockTransport(srv))
    refused_and_untouched(r, out, srv, r"^no usable rows in empty.jsonl: the input is empty$")


def test_exit_codes_are_documented_in_help():
    from hsx_client.corpus.cli import build_extract_parser

    text = build_extract_parser().format_help()
    for code in ("0 ", "1 ", "2 ", "130"):
        assert re.search(rf"^\s+{code}", text, re.M), f"exit code {code} not in --help"
    assert "dropped by policy" in text and "failed samples" in text
    readme = (REPO / "README.md").read_text()
    assert "| 130 | interrupted" in readme and "| 2 | refused before any work" in readme


def test_progress_counts_this_runs_work_and_never_shows_100_percent_with_nothing_done(capsys):
    import io

    buf = io.StringIO()
    p = Progress(0, stream=buf)
    p.close()
    assert "100%" not in buf.getvalue()
    buf = io.StringIO()
    p = Progress(4, stream=buf)
    p.sample_done(tokens=1, wire_bytes=1, written_bytes=1)
    p.close()
    assert "1/4" in buf.getvalue() and "100%" not in buf.getvalue()


def test_quiet_silences_datasets_progress_bars(tmp_path, capfd):
    import datasets

    from hsx_client.corpus.extract import _silence_progress_bars

    try:
        _silence_progress_bars()
        datasets.Dataset.from_dict({"a": list(range(10))}).save_to_disk(str(tmp_path / "ds"))
        assert "Saving the dataset" not in capfd.readouterr().err
    finally:
        datasets.enable_progress_bars()


# ------------------------------------------------------------------ disk estimate (11 Also)
def test_disk_estimate_uses_the_served_tokenizers_counts(tmp_path, data):
    """The server tokenizes a sample of the rows (POST /tokenize, no prefill); the ratio of
    real to estimated tokens scales the estimate (here: 2 tokens per id, say)."""
    out = tmp_path / "out"

    class Counting(InfoServer):
        counted = 0

        def __call__(self, request):
            if request.url.path == "/tokenize":
                self.counted += 1
                n = 2 * len(json.loads(request.content)["input_ids"])
                return httpx.Response(200, json={"token_ids": [1] * n, "loss_mask": None, "num_input_tokens": n})
            return super().__call__(request)

    srv = Counting()
    r = run(cfg_for(data, out), FakeFormat(), srv)
    assert r.exit_code == 0 and srv.counted == N, r.summary
    assert r.summary["token_counts"] == {"ratio": 2.0, "kept": 1.0}
    tokens = sum(1 + i % 3 for i in range(N))
    assert r.summary["disk_estimate_bytes"] == int(2 * tokens * FakeFormat().bytes_per_token(None) + 4096 * N)
    r = run(cfg_for(data, tmp_path / "o2"), FakeFormat(), InfoServer())  # a server without /tokenize
    assert r.exit_code == 0 and r.summary["token_counts"] is None


def test_too_long_samples_with_truncation_error_fail_naming_the_flags(tmp_path, data):
    out = tmp_path / "out"

    class TooLong(InfoServer):
        def __call__(self, request):
            if request.url.path == "/hidden_states" and json.loads(request.content)["input_ids"][0] == 6:
                self.bodies.append(json.loads(request.content))
                return httpx.Response(413, json={"error": {"type": "too_large", "request_id": "r", "message":
                    "700 tokens exceed max_length of 511 tokens; send truncation='right' or 'left' to cut"}})
            return super().__call__(request)

    r = run(cfg_for(data, out, truncation="error"), FakeFormat(), TooLong())
    assert r.exit_code == 1 and r.summary["failed"] == 1, r.summary
    (reason,) = r.summary["failed_reasons"]
    assert reason["reason"].startswith("413 too_large: 700 tokens exceed max_length of 511 tokens")
    assert "--max-length N with --truncation right or left" in reason["reason"]
    assert reason["example"].startswith("in.jsonl:")  # the input file:line of one such sample
