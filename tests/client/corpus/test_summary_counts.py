"""Issue 25 without an engine: what `hsx extract`'s summary counts (real numbers in the
reasons, per-server requests of the fan-out alone, worker processes' counts added in,
truncation with --states none, --quiet), the silent losses it now names (tools a chat
template ignores, SpecForge samples supervised only on their last token) and the online
trainer's CPU route. The same against a real server: tests/e2e/test_first_hour_e2e.py and
tests/e2e/test_speculators_online.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from _first_hour import L, H, InfoServer, run
from _extract_fakes import N, FakeFormat, cfg_for, data, hooks  # noqa: F401  (data: a fixture)

from hsx import wire
from hsx_client.corpus import cli
from hsx_client.corpus import extract as ex
from hsx_client.corpus.formats import SpecForgeFormat, SpeculatorsFormat
from hsx_client.corpus.formats.common import drop_reason
from hsx_client.corpus.formats.speculators_variants import TokensResponse
from hsx_client.corpus.progress import Progress, format_summary, reason_counts
from hsx_client.corpus.template_tools import tools_not_rendered


# ------------------------------------------------------------------ reasons with their numbers
def test_a_reason_shows_its_real_numbers_or_their_range():
    msg = "no supervised token after right truncation from {} to 511 tokens: the loss mask is all zero"
    entries = [{"status": 422, "type": "no_supervised_tokens", "message": msg.format(n), "key": f"f:{n}"}
               for n in (700, 2048, 530)]
    (r,) = reason_counts(entries)
    assert r["count"] == 3 and r["example"] == "f:700"
    assert r["reason"] == ("422 no_supervised_tokens: no supervised token after right truncation from 530-2048 "
                           "to 511 tokens: the loss mask is all zero")
    (one,) = reason_counts(entries[:1])
    assert "from 700 to 511 tokens" in one["reason"] and " N " not in one["reason"]
    text = format_summary({"dropped_reasons": reason_counts(entries)})
    assert "from 530-2048 to 511 tokens" in text and "from N to N" not in text


# ------------------------------------------------------------------ per-server counts
class _Stats:
    def __init__(self):
        self.s = {"http://a": {"in_flight": 0, "ok": 0, "refused": 0, "retries": 0, "errors": 0, "healthy": True,
                               "wire_bytes": 0, "transfer": "http"}}

    def __call__(self):
        return {u: dict(v) for u, v in self.s.items()}


def test_server_counts_leave_out_the_requests_before_the_run_and_add_the_workers():
    stats = _Stats()
    stats.s["http://a"].update(ok=66, wire_bytes=10)  # /info and the disk estimate's /tokenize calls
    p = Progress(5, quiet=True, server_stats=stats)
    stats.s["http://a"]["ok"] += 2  # the fan-out in this process
    p.add_server_stats({"http://a": {"in_flight": 0, "ok": 3, "refused": 1, "retries": 0, "errors": 0,
                                     "healthy": True, "wire_bytes": 7, "transfer": "shm-lease"}})
    p.add_server_stats({"http://a": {"in_flight": 0, "ok": 4, "refused": 2, "retries": 1, "errors": 0,
                                     "healthy": True, "wire_bytes": 5, "transfer": "shm-lease"}})
    a = p.summary()["servers"]["http://a"]
    assert (a["ok"], a["refused"], a["retries"], a["wire_bytes"], a["transfer"]) == (9, 3, 1, 12, "shm-lease")
    assert p.summary()["retries"] == 1
    line = format_summary({"servers": p.summary()["servers"]})
    assert "http://a: requests ok 9 refused 3 retries 1" in line


def test_expired_leases_are_summed_over_servers_and_workers_and_named():
    """Issue 36 item 2: leases that expired (each such sample asked again over HTTP) are counted
    in the summary; with --workers, the worker processes' counts are added in."""
    stats = _Stats()
    stats.s["http://a"].update(leases_expired=1)  # before the run: left out
    p = Progress(5, quiet=True, server_stats=stats)
    stats.s["http://a"]["leases_expired"] += 2
    p.add_server_stats({"http://a": {"ok": 3, "leases_expired": 4, "healthy": True}})
    s = p.summary()
    assert s["leases_expired"] == 6
    assert "6 leases expired, asked again over HTTP" in format_summary(s)
    assert "leases expired" not in format_summary({**s, "leases_expired": 0})


def test_ok_counts_the_samples_of_the_run_not_the_disk_estimates_tokenize_calls(tmp_path, data):
    class Counting(InfoServer):  # a server that counts tokens (/tokenize), as a real one does
        def __call__(self, request):
            if request.url.path == "/tokenize":
                ids = json.loads(request.content)["input_ids"]
                return httpx.Response(200, json={"token_ids": ids, "loss_mask": None, "num_input_tokens": len(ids)})
            return super().__call__(request)

    srv = Counting()
    srv.empty_mask = {2, 5}
    r = run(cfg_for(data, tmp_path / "out"), FakeFormat(), srv)
    assert r.exit_code == 0, r.summary
    servers = r.summary["servers"].values()
    ok, refused = sum(s["ok"] for s in servers), sum(s["refused"] for s in servers)
    assert (ok, refused) == (r.summary["done"], 2) == (N - 2, 2), r.summary["servers"]


# ------------------------------------------------------------------ --states none counts what was cut
def test_a_token_table_sample_keeps_the_count_before_truncation():
    raw = TokensResponse({"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "num_input_tokens": 900,
                          "layer_ids": [1, 2, 3, 4]})
    assert int(raw.decode().metadata["num_input_tokens"]) == 900


# ------------------------------------------------------------------ --quiet hides the bar, not the summary
def test_quiet_prints_the_summary_without_a_bar(tmp_path, data, monkeypatch, capsys):
    srv = InfoServer()
    real = ex.run_extract
    monkeypatch.setattr(ex, "run_extract", lambda cfg: real(cfg, hooks(FakeFormat()), transport=httpx.MockTransport(srv)))
    rc = cli.extract_main(["--server", "http://a", "--input", str(data), "--output", str(tmp_path / "o"),
                           "--format", "speculators", "--quiet", "--workers", "1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"status: complete  done {N}/{N}" in err and "extract:" not in err and "sample/s" not in err, err


# ------------------------------------------------------------------ tools the template does not render
class _Tokenizer:
    """POST /tokenize of a template that renders `tools` (or not)."""

    def __init__(self, renders_tools: bool):
        self.renders_tools, self.calls = renders_tools, 0

    async def tokenize(self, body):
        self.calls += 1
        n = 10 + (5 if self.renders_tools and body.get("tools") else 0)
        return {"token_ids": list(range(min(n, body.get("max_length") or n))), "num_input_tokens": n}


def _chats():
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    return [dict(chat, tools=[tool]) for _ in range(4)] + [chat, {"prompt": "x", "tools": [tool]}]


@pytest.mark.parametrize("renders", [False, True])
def test_tools_a_template_ignores_are_counted_from_one_probe(renders):
    tok = _Tokenizer(renders)
    n = asyncio.run(tools_not_rendered(tok, _chats(), max_length=8))  # cut: the count before it decides
    assert n == (0 if renders else 4) and tok.calls == 2


def test_the_summary_warns_once_about_tools_not_rendered():
    text = format_summary({"tools_not_rendered": 4})
    assert text.count("tool definitions") == 1 and "4 sample(s)" in text and "--chat-template" in text
    assert "tool" not in format_summary({"tools_not_rendered": 0})


# ------------------------------------------------------------------ SpecForge: nothing but the last token
def test_specforge_drops_a_sample_supervised_only_on_its_last_token():
    last_only = np.array([0, 0, 0, 1], np.uint8)
    assert "last" in drop_reason(SpecForgeFormat(), last_only)
    assert drop_reason(SpeculatorsFormat(), last_only) is None  # speculators' shift drops the first token
    assert drop_reason(SpecForgeFormat(), np.array([0, 0, 1, 1], np.uint8)) is None
    assert "all zero" in drop_reason(SpeculatorsFormat(), np.zeros(4, np.uint8))
    assert drop_reason(SpecForgeFormat(), None) is None


def test_a_specforge_run_drops_and_counts_last_token_only_samples(tmp_path, data):
    class LastOnly(InfoServer):
        def __call__(self, request):
            if request.url.path != "/hidden_states":
                return super().__call__(request)
            ids = json.loads(request.content)["input_ids"]
            t = len(ids)
            specs = [wire.TensorSpec("hidden_states", "F32", (t, L, H)), wire.TensorSpec("token_ids", "I64", (t,)),
                     wire.TensorSpec("loss_mask", "U8", (t,))]
            mask = np.ones(t, np.uint8)
            if ids[0] == 4:
                mask[:-1] = 0
            body = (wire.encode_header(specs, {"layer_ids": "[1,2,3,4]"}) + np.zeros((t, L, H), np.float32).tobytes()
                    + np.asarray(ids, np.int64).tobytes() + mask.tobytes())
            return httpx.Response(200, content=body, headers={"Content-Type": wire.MEDIA_TYPE})

    class SpecForgeLike(FakeFormat):
        drop_reason = SpecForgeFormat.drop_reason  # the EAGLE-3 rule (FakeFormat.draft is eagle3)

    r = run(cfg_for(data, tmp_path / "out"), SpecForgeLike(), LastOnly())
    one_token = sum(1 for i in range(N) if i % 3 == 0)  # their one token is the last one too
    assert r.exit_code == 0 and r.summary["dropped"] == 1 + one_token, r.summary
    (reason,) = r.summary["dropped_reasons"]
    assert "SpecForge" in reason["reason"] and reason["count"] == 1 + one_token
    stored = [json.loads(x) for x in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert len(stored) == r.summary["done"] == N - 1 - one_token


# ------------------------------------------------------------------ online training on a CPU
def test_the_trainer_takes_device_cpu_and_sets_what_a_cpu_runs():
    from hsx_client.training.speculators_train import _split_device

    assert _split_device(["--data-path", "d"]) == ("auto", ["--data-path", "d"])
    dev, rest = _split_device(["--device", "cpu", "--data-path", "d", "--draft-attn-impl=flex_attention"])
    assert dev == "cpu"
    assert rest == ["--data-path", "d", "--draft-attn-impl=flex_attention", "--loss-implementation", "eager"]


# ------------------------------------------------------------------ the README names what a user looks at
def test_readme_names_the_files_a_run_writes_and_the_inputs_it_takes(tmp_path, data):
    from _server import REPO

    from hsx_client.corpus import store

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Extracting a corpus"):readme.index("### On CPU")]
    out = tmp_path / "out"
    srv = InfoServer()
    srv.empty_mask = {2}
    assert run(cfg_for(data, out), FakeFormat(), srv).exit_code == 0
    for name in (store.MANIFEST_NAME, store.FAILED_NAME, store.BAD_ROWS_NAME, store.CORPUS_NAME):
        assert f"`{name}`" in section and (out / name).exists(), name
    entry = json.loads((out / store.FAILED_NAME).read_text().splitlines()[0])
    assert entry["kind"] == "dropped" and '`"kind": "dropped"`' in section
    assert "`truncated_from`" in section and "`--quiet` hides only the\n  progress bars" in section
    for kind in ("OpenAI", "ShareGPT", "Alpaca", "MT-Bench", "`{\"prompt\"}`", "`{\"input_ids\"", "hf:org/name", "glaive"):
        assert kind in section, kind
