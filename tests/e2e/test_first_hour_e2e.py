"""Issue 10's "Done when", against a real `hsx serve` (vLLM CPU, the trained stories260K with
its default layers, the llama3 template): `hsx extract --server URL --input FILE --output DIR
--format F` with no other flags stores every usable conversation, says what it cut and
dropped and why, and both trainers' readers load the result. Also the server's pre-engine
refusal of rows without a supervised token, `--truncation left` keeping the supervised tail,
refusals before any sample, and issue 11's SIGKILL at the compaction journal, then
`hsx verify`, then `hsx extract`: complete and verified."""

from __future__ import annotations

import json
import os
import re
import subprocess

import httpx
import pytest

from _e2e_helpers import HSX, cli_env, specforge_batches, speculators_rows
from _server import CHAT, REPO, STORIES, TEMPLATES, ServerProcess
from conftest import need_fixtures, need_vllm
from hsx_tools.server_process import MetricValues

pytestmark = [pytest.mark.engine, pytest.mark.fixtures, pytest.mark.slow]

OASST = CHAT / "oasst" / "threads.messages.jsonl"
GLAIVE = CHAT / "llamafactory" / "glaive_toolcall_en_demo.json"
QUESTIONS = CHAT / "mt_bench" / "question.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_vllm()
    need_fixtures()
    s = ServerProcess(str(STORIES), "--chat-template", str(TEMPLATES / "llama3.jinja"),
                      log_dir=tmp_path_factory.mktemp("first-hour"), name="first-hour")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def extract(server, out, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    argv = [*HSX, "extract", "--server", server.url, "--output", str(out), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or cli_env())


def corpus(out) -> dict:
    return json.loads((out / "hsx_corpus.json").read_text())


def hsx_verify(out) -> subprocess.CompletedProcess:
    return subprocess.run([*HSX, "verify", str(out), "--quiet"], capture_output=True, text=True, timeout=300,
                          env=cli_env())


def test_the_server_default_layers_make_an_eagle3_corpus(server):
    info = httpx.get(server.url + "/info").json()
    assert info["num_hidden_layers"] == 5 and info["layer_ids"] == [1, 2, 3, 5]  # was [2, 5]


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_done_when_oasst_with_no_other_flags(server, tmp_path, fmt):
    out = tmp_path / fmt
    r = extract(server, out, "--input", str(OASST), "--format", fmt)
    assert r.returncode == 0, r.stderr[-3000:]
    c = corpus(out)
    counts = c["counts"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["settings"]["max_length"] == 511 == c["max_length"]  # the server's max_tokens_per_request
    assert counts["failed"] == 0 and counts["done"] + counts["dropped"] == counts["planned"]
    assert counts["done"] > 0 and counts["truncated"] > 0
    # It says what it cut and dropped, and why.
    assert f"cut: {counts['truncated']} stored sample(s) were longer than --max-length 511" in r.stderr
    if counts["dropped"]:
        assert f"dropped: {counts['dropped']} x 422 no_supervised_tokens: no supervised token" in r.stderr
    assert "Saving the dataset" in r.stderr or fmt == "specforge"  # without --quiet the bars show...
    assert hsx_verify(out).returncode == 0
    if fmt == "speculators":
        rows = speculators_rows(out)
        assert len(rows) == counts["done"] and all(int(row["loss_mask"].sum()) > 0 for row in rows)
    else:
        batches = specforge_batches(out)
        assert len(batches) == counts["done"]
        assert all(int(b["loss_mask"].sum()) > 0 for b in batches.values())


def test_quiet_hides_the_bars_not_the_summary(server, tmp_path):
    r = extract(server, tmp_path / "q", "--input", str(OASST), "--format", "speculators", "--max-samples", "40",
                "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Saving the dataset" not in r.stderr and "extract:" not in r.stderr and "sample/s" not in r.stderr, r.stderr
    assert "status: complete  done " in r.stderr and "/40" in r.stderr, r.stderr  # issue 25: it hid this too


def _summary(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_glaive_summary_counts_what_happened_with_workers(server, tmp_path):
    """Issue 25, a newcomer's glaive run at the defaults (llama3 template, per turn, cut at
    511): the dropped reason shows its numbers, the per-server requests are the stored and
    refused samples (not the disk estimate's /tokenize calls) also when worker processes
    did the work, the tools llama3.jinja does not render are counted, and --states none
    counts what it cut as the full run does."""
    args = ["--input", str(GLAIVE), "--format", "speculators", "--max-samples", "60", "--json"]
    r = extract(server, tmp_path / "full", *args, "--workers", "2")
    s = _summary(r)
    assert s["done"] > 0 and s["dropped"] > 0 and s["truncated"] > 0, s
    (st,) = s["servers"].values()
    assert (st["ok"], st["refused"]) == (s["done"], s["dropped"]), (st, s["done"], s["dropped"])
    assert f"requests ok {s['done']} refused {s['dropped']}" in r.stderr, r.stderr[-3000:]
    dropped = [line for line in r.stderr.splitlines() if line.startswith("dropped: ")]
    assert dropped and all("from N" not in line and "to N tokens" not in line for line in dropped), dropped
    assert re.search(r"from \d+(-\d+)? to 511 tokens", dropped[0]), dropped
    assert s["tools_not_rendered"] > 0 and "tool definitions" in r.stderr, r.stderr[-3000:]
    t = _summary(extract(server, tmp_path / "tokens", *args, "--states", "none"))
    assert (t["done"], t["dropped"], t["truncated"]) == (s["done"], s["dropped"], s["truncated"]), t
    assert t["tools_not_rendered"] == s["tools_not_rendered"]


def test_a_cut_that_leaves_only_the_last_token_supervised_is_dropped_for_specforge(server, tmp_path):
    """Issue 25: SpecForge's loader unmasks the last token (its target lies past the row),
    so a real chat cut right after the first token of its reply would be stored with nothing
    to train on. It is dropped, with the reason; speculators (whose shift drops the first
    token, not the last) still stores it."""
    chat = json.loads(OASST.read_text().splitlines()[0])["messages"][:2]
    assert [m["role"] for m in chat] == ["user", "assistant"]
    rows = tmp_path / "one.jsonl"
    rows.write_text(json.dumps({"messages": chat}) + "\n")
    mask = httpx.post(server.url + "/tokenize", json={"messages": chat, "assistant_mask": "last"}).json()["loss_mask"]
    cut = str(mask.index(1) + 1)  # the reply's first token is the row's last
    sf = extract(server, tmp_path / "sf", "--input", str(rows), "--format", "specforge", "--max-length", cut, "--json")
    s = json.loads(sf.stdout)
    assert sf.returncode == 1 and (s["done"], s["dropped"]) == (0, 1), sf.stderr[-3000:]
    assert "dropped: 1 x " in sf.stderr and "no supervised token but the last, which SpecForge's loader unmasks" \
        in sf.stderr, sf.stderr
    assert not list((tmp_path / "sf").rglob("*.ckpt"))
    sp = _summary(extract(server, tmp_path / "sp", "--input", str(rows), "--format", "speculators", "--max-length", cut,
                          "--json"))
    assert (sp["done"], sp["dropped"]) == (1, 0), sp


def test_left_truncation_keeps_the_supervised_tail(server, tmp_path):
    """glaive per turn: right truncation drops the rows whose reply lies past the limit
    (422 of 957 in the issue's run); left keeps the end, where the reply is: none dropped."""
    out = tmp_path / "left"
    r = extract(server, out, "--input", str(GLAIVE), "--format", "speculators", "--truncation", "left",
                "--max-samples", "300", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    counts = corpus(out)["counts"]
    assert counts["dropped"] == 0 and counts["done"] == 300 and counts["truncated"] > 0
    assert all(int(row["loss_mask"].sum()) > 0 for row in speculators_rows(out))


def test_a_row_with_no_supervised_token_is_refused_before_the_engine(server):
    url = server.url
    body = {"messages": [{"role": "user", "content": "Once upon a time " * 80},
                         {"role": "assistant", "content": "The end."}],
            "assistant_mask": "last", "max_length": 32, "truncation": "right"}
    count = httpx.post(url + "/tokenize", json=body).json()
    assert len(count["token_ids"]) == 32 and count["num_input_tokens"] > 32 and not any(count["loss_mask"])
    before = MetricValues(httpx.get(url + "/metrics").text)
    r = httpx.post(url + "/hidden_states", json={**body, "require_supervised": True})
    assert r.status_code == 422 and r.json()["error"]["type"] == "no_supervised_tokens", r.text
    assert "after right truncation from" in r.json()["error"]["message"]
    after = MetricValues(httpx.get(url + "/metrics").text)
    # no phase of the request ran past the tokenizer (no admission of tokens, no prefill)
    assert after.by_label("hsx_phase_seconds_count", "phase") == before.by_label("hsx_phase_seconds_count", "phase")
    # without the flag the same request is served (the mask is all zero): the client drops it
    ok = httpx.post(url + "/hidden_states", json=body)
    assert ok.status_code == 200 and ok.headers["x-hsx-num-tokens"] == "32"


def test_refusals_before_any_sample_leave_no_directory(server, tmp_path):
    before = MetricValues(httpx.get(server.url + "/metrics").text).by_label("hsx_phase_seconds_count", "phase")
    for args, words in (
        (["--input", str(OASST), "--draft-vocab-size", "32000"], "--draft-vocab-size 32000 must be in 1..512"),
        (["--input", str(OASST), "--max-length", "4096"], "--max-length 4096 exceeds the 511 tokens"),
        (["--input", str(OASST), "--layers", "2,5"], "need 4 layers"),
        (["--input", str(QUESTIONS)], "no usable rows in question.jsonl: 80 rows have no assistant turn "
                                      "(questions only; pair them with answers"),
        (["--input", str(tmp_path / "missing.jsonl")], "--input: input not found"),
    ):
        out = tmp_path / "never"
        r = extract(server, out, "--format", "speculators", *args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()
    assert MetricValues(httpx.get(server.url + "/metrics").text).by_label("hsx_phase_seconds_count", "phase") == before


def test_sigkill_at_the_compaction_journal_then_verify_then_extract(server, tmp_path):
    """Issue 11.5: verify after a crash between the journal and the renames used to call
    the samples missing and strand the corpus for good."""
    out = tmp_path / "c"
    args = ["--input", str(OASST), "--format", "speculators", "--max-samples", "60", "--quiet"]
    env = {**cli_env(), "HSX_KILL_AT_COMPACTION_JOURNAL": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "fault_inject_client"),
                                          os.environ.get("PYTHONPATH", "")])}
    r = extract(server, out, *args, env=env)
    assert r.returncode == -9, r.stderr[-2000:]
    journal = json.loads((out / "hsx_compaction.json").read_text())
    assert journal["moves"], "the run must have holes to compact (dropped rows)"
    assert not (out / "hsx_corpus.json").exists()
    v = hsx_verify(out)
    assert v.returncode == 1 and "BAD" not in v.stderr and "0 missing, 0 bad" in v.stderr, v.stderr
    assert "rerun the same `hsx extract` command to finish it" in v.stderr
    assert not (out / "verify.json").exists()
    r = extract(server, out, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert hsx_verify(out).returncode == 0
    counts = corpus(out)["counts"]
    assert len(speculators_rows(out)) == counts["done"] == 60 - counts["dropped"]
