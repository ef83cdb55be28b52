"""The extract/verify run loop with a fake format, fake inputs and a MockTransport server."""

from __future__ import annotations

import json
from collections import Counter, namedtuple

import httpx

from _extract_fakes import (  # noqa: F401  (data: a fixture)
    N, FakeFormat, FakeServer, cfg_for, data, hooks, manifest_done, run,
)
from hsx_client.corpus import extract as ex
from hsx_client.corpus import journal, store
from hsx_client.corpus.disk_estimate import estimate_tokens
from hsx_client.corpus.plan import pending
from hsx_client.corpus.verify import verify_corpus


# ------------------------------------------------------------------ tests
def test_full_run_and_verify(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 0, r.summary
    assert r.summary["done"] == N and r.summary["bad_rows"] == 1
    done, entries = manifest_done(out)
    assert sorted(done) == list(range(N)) and len(entries) == N
    plan = json.loads((out / "plan.json").read_text())
    assert sorted(plan["keys"]) == sorted(f"in.jsonl:{n}" for n in range(1, N + 1))
    assert plan["keys"] != [f"in.jsonl:{n}" for n in range(1, N + 1)]  # shuffled
    for i, e in done.items():  # index i holds the sample planned at i
        assert e["key"] == plan["keys"][i]
        first = int(e["key"].split(":")[1]) - 1
        assert e["record"]["first"] == first
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert corpus["counts"]["done"] == N and corpus["model"] == "tiny" and corpus["seed"] == 7
    assert corpus["layer_ids"] == [1, 2, 3, 4] and "index.json" in corpus["finalize_files"]
    assert all(v == 1 for v in srv.requests.values()) and len(srv.requests) == N
    rep = verify_corpus(out, lambda name: fmt)
    assert rep["ok"], rep
    # rerunning the finished command does nothing
    r2 = run(cfg_for(data, out), fmt, srv)
    assert r2.exit_code == 0 and sum(srv.requests.values()) == N


def test_the_run_loop_reports_through_its_hooks(tmp_path, data):
    """RunHooks: what the benchmark times the fan-out with, instead of overriding the loop."""
    from hsx_client.corpus.run import RunHooks

    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    srv.bad_ids = {3}
    events = []
    hooks_ = RunHooks(
        on_start=lambda run: events.append(("start", len(run.queue))),
        on_stored=lambda run, i, entry: events.append(("stored", i, entry["key"] == run.keys[i])),
        on_failed=lambda run, i, entry: events.append(("failed", i, entry["kind"])),
        on_end=lambda run: events.append(("end", len(run.done), len(run.failed))),
    )
    r = ex.run_extract(cfg_for(data, out), hooks(fmt), transport=httpx.MockTransport(srv), run_hooks=hooks_)
    assert r.exit_code == 1 and r.status == "complete_with_failures" and r.summary["finalize_s"] >= 0
    assert events[0] == ("start", N) and events[-1] == ("end", N - 1, 1)
    stored = [e for e in events if e[0] == "stored"]
    assert len(stored) == N - 1 and all(ok for _, _, ok in stored)
    assert [e for e in events if e[0] == "failed"] == [("failed", plan_index_of(out, "in.jsonl:4"), "bad_request")]


def plan_index_of(out, key):
    return json.loads((out / "plan.json").read_text())["keys"].index(key)


def test_crash_then_resume_gives_each_sample_once(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    fmt.crash_after = 9
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 1 and r.status == "error"
    assert not (out / "hsx_corpus.json").exists()
    done1, _ = manifest_done(out)
    assert 0 < len(done1) <= 9
    # what a kill -9 leaves: a temp file and a torn manifest line
    (out / "hs" / f".hs_999.st{store.TMP_MARK}1-dead").write_bytes(b"partial")
    with open(out / store.MANIFEST_NAME, "ab") as f:
        f.write(b'{"key": "in.jsonl:1", "index": 0, "fi')
    fmt.crash_after = None
    srv.requests.clear()
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 0, r.summary
    done, entries = manifest_done(out)
    assert sorted(done) == list(range(N))
    assert Counter(e["index"] for e in entries) == Counter(range(N))  # no duplicates
    plan = json.loads((out / "plan.json").read_text())
    redone = set(srv.requests)
    assert redone == {plan["keys"][i] for i in range(N) if i not in done1}  # only the missing ones
    assert not list(out.rglob(f"*{store.TMP_MARK}*"))
    assert verify_corpus(out, lambda name: fmt)["ok"]


def test_interrupt_then_resume(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    extractor = ex.Extractor(cfg_for(data, out), hooks(fmt), transport=httpx.MockTransport(srv))
    seen = []

    def on_request(body):
        seen.append(body["id"])
        if len(seen) == 5:
            extractor.request_stop("interrupted")

    srv.on_request = on_request
    import asyncio

    r = asyncio.run(extractor.run())
    assert r.exit_code == 130 and r.status == "interrupted"
    done1, _ = manifest_done(out)
    assert len(done1) < N
    srv.on_request = None
    r = run(cfg_for(data, out, resume=True), fmt, srv)
    assert r.exit_code == 0
    done, entries = manifest_done(out)
    assert sorted(done) == list(range(N)) and len(entries) == N


def test_bad_request_recorded_and_skipped(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    srv.bad_ids = {3, 5}
    r = run(cfg_for(data, out), fmt, srv)
    # A corpus, but smaller than planned because samples failed: not a success (issue 10)
    assert r.exit_code == 1 and r.summary["failed"] == 2 and r.summary["done"] == N - 2
    assert r.status == "complete_with_failures" and "--retry-failed" in r.summary["message"]
    assert r.summary["failed_reasons"] == [{"reason": "400 invalid: bad sample", "count": 2,
                                            "example": r.summary["failed_reasons"][0]["example"]}]
    failed, _, _ = journal.read_jsonl(out / store.FAILED_NAME)
    assert {f["key"] for f in failed} == {"in.jsonl:4", "in.jsonl:6"}
    assert all(f["kind"] == "bad_request" and f["status"] == 400 for f in failed)
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert len(corpus["failed_indices"]) == 2 and corpus["counts"]["failed"] == 2
    assert verify_corpus(out, lambda name: fmt)["ok"]
    srv.requests.clear()
    assert run(cfg_for(data, out), fmt, srv).exit_code == 1 and not srv.requests  # not retried, still not a success
    srv.bad_ids = set()
    r = run(cfg_for(data, out, retry_failed=True), fmt, srv)
    assert r.exit_code == 0 and r.summary["done"] == N and sum(srv.requests.values()) == 2


def test_settings_mismatch_refused(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    fmt.crash_after = 2
    run(cfg_for(data, out), fmt, srv)
    r = run(cfg_for(data, out, seed=8, max_length=512), fmt, srv)
    assert r.exit_code == 2
    assert "--seed" in r.summary["message"] and "--max-length" in r.summary["message"]
    data.write_text(data.read_text() + json.dumps({"input_ids": [1, 2]}) + "\n")
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 2 and f"input {data} changed" in r.summary["message"]


def test_verify_finds_corruption_and_resume_redoes_exactly_those(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    assert run(cfg_for(data, out), fmt, srv).exit_code == 0
    done, _ = manifest_done(out)
    flip = out / f"hs/hs_{3}.st"
    b = bytearray(flip.read_bytes())
    b[-1] ^= 0xFF  # same size, corrupt content
    flip.write_bytes(bytes(b))
    trunc = out / f"hs/hs_{10}.st"
    trunc.write_bytes(trunc.read_bytes()[:-7])
    rep = verify_corpus(out, lambda name: fmt)
    assert not rep["ok"] and sorted(x["index"] for x in rep["bad"]) == [3, 10]
    assert (out / store.VERIFY_NAME).exists()
    srv.requests.clear()
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 0, r.summary
    assert set(srv.requests) == {done[3]["key"], done[10]["key"]}
    assert not (out / store.VERIFY_NAME).exists()
    assert verify_corpus(out, lambda name: fmt)["ok"]


def test_truncated_file_redone_on_resume_without_verify(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    assert run(cfg_for(data, out), fmt, srv).exit_code == 0
    done, _ = manifest_done(out)
    p = out / "hs/hs_5.st"
    p.write_bytes(p.read_bytes()[:10])
    srv.requests.clear()
    assert run(cfg_for(data, out), fmt, srv).exit_code == 0
    assert set(srv.requests) == {done[5]["key"]}
    # --verify catches a same-size corruption without a prior `hsx verify`
    p = out / "hs/hs_6.st"
    b = bytearray(p.read_bytes())
    b[-2] ^= 1
    p.write_bytes(bytes(b))
    srv.requests.clear()
    assert run(cfg_for(data, out, verify=True), fmt, srv).exit_code == 0
    assert set(srv.requests) == {done[6]["key"]}


def test_lock_excludes_second_writer(tmp_path, data):
    out = tmp_path / "out"
    lock = journal.DirLock(out).acquire()
    try:
        r = run(cfg_for(data, out), FakeFormat(), FakeServer())
        assert r.exit_code == 2 and "in use" in r.summary["message"]
    finally:
        lock.release()


def test_disk_refusal_and_force(tmp_path, data, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: Usage(10**9, 0, 1000))
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 2 and "--force-disk" in r.summary["message"]
    assert not srv.requests
    assert run(cfg_for(data, out, force_disk=True), fmt, srv).exit_code == 0


def test_malformed_bodies_fail_their_samples_without_the_5xx_breaker(tmp_path, data):
    """A body cut short on every attempt fails its sample (retried by the next run) but is
    no engine failure: more such samples in a row than the 5xx breaker allows do not stop the run."""
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    srv.malformed = True
    r = run(cfg_for(data, out, max_attempts=1), fmt, srv)
    assert r.summary["failed"] == N and "stopped" not in r.summary["message"]  # every sample tried
    failed, _, _ = journal.read_jsonl(out / store.FAILED_NAME)
    assert len(failed) == N > 10 and {(f["kind"], f["type"], f["status"]) for f in failed} == {
        ("server_error", "bad_response", None)}
    srv.malformed = False
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 0 and r.summary["done"] == N


def test_servers_down_stops_resumable(tmp_path, data):
    out = tmp_path / "out"
    fmt, srv = FakeFormat(), FakeServer()
    srv.down = True
    r = run(cfg_for(data, out, max_attempts=2), fmt, srv)
    assert r.exit_code == 1 and "stopped" in r.summary["message"]
    srv.down = False
    r = run(cfg_for(data, out), fmt, srv)
    assert r.exit_code == 0 and r.summary["done"] == N


def test_pending_is_the_plan_order_minus_done_and_failed_with_an_optional_selection():
    assert pending(6, {0: {}}, {2: {}}) == [1, 3, 4, 5]
    assert pending(6, {0: {}}, {2: {}}, select=lambda i: i % 2 == 1) == [1, 3, 5]  # e.g. one shard of two


def test_estimate_tokens():
    assert estimate_tokens({"input_ids": list(range(100))}, 50, None) == 50
    assert estimate_tokens({"prompt": "x" * 300}, None, None) == 101
    m = {"messages": [{"role": "user", "content": "a" * 90}, {"role": "assistant", "content": [{"type": "text", "text": "b" * 30}]}]}
    assert estimate_tokens(m, None, 20) == 20
    assert estimate_tokens(m, None, None) == (90 + 30 + 64) // 3 + 1


def test_cli_extract_and_verify(tmp_path, data, monkeypatch, capsys):
    from hsx_client.corpus import cli

    fmt, srv = FakeFormat(), FakeServer()
    orig = ex.run_extract
    monkeypatch.setattr(ex, "run_extract", lambda cfg: orig(cfg, hooks(fmt), transport=httpx.MockTransport(srv)))
    from hsx_client.corpus import formats

    monkeypatch.setattr(formats, "get_format", lambda name: fmt)  # what `hsx verify` opens the corpus with
    out = tmp_path / "out"
    rc = cli.extract_main(["--server", "http://s1", "--input", str(data), "--output", str(out),
                           "--format", "speculators", "--layers", "4,2", "--quiet", "--json", "--no-shuffle"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    summary = json.loads(cap.out)
    assert summary["status"] == "complete" and summary["done"] == N and summary["exit_code"] == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["settings"]["layers"] == [2, 4] and plan["settings"]["shuffle"] is False
    assert plan["keys"] == [f"in.jsonl:{n}" for n in range(1, N + 1)]
    assert cli.verify_main([str(out), "--quiet"]) == 0
    (out / "hs/hs_0.st").write_bytes(b"garbage")
    assert cli.verify_main([str(out), "--quiet", "--json"]) == 1
    cap = capsys.readouterr()
    assert "BAD 0" in cap.err and json.loads(cap.out)["bad_samples"] == 1
    # --layers the server lacks
    rc = cli.extract_main(["--server", "http://s1", "--input", str(data), "--output", str(tmp_path / "o2"),
                           "--format", "speculators", "--layers", "5", "--quiet"])
    assert rc == 2 and "serves layers" in capsys.readouterr().err
