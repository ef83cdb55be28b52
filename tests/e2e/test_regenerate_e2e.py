"""Issue 28 end to end: `hsx regenerate` (a subprocess) against the shared e2e servers
(stories260K fp32, llama3 template; generation on hsx serve's embedded engine), then
`hsx extract` on its output, read by both trainers' own readers.

Proven here: each regenerated turn's recorded ids are exactly what the corpus holds, and
its loss mask supervises exactly the generated ids; SIGKILL mid-run then a rerun gives the
byte-identical file of an uninterrupted run; bad inputs are refused with exit 2 and a
message that says why.
"""

from __future__ import annotations

import json
from collections import Counter
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import need_fixtures
from _e2e_helpers import HSX, check_specforge_corpus, check_speculators_corpus, cli_env, run_extract
from _server import CHAT

pytestmark = [pytest.mark.engine, pytest.mark.fixtures, pytest.mark.slow]

MAX_TOKENS = 24
MAX_LENGTH = 512


@pytest.fixture(scope="module")
def servers(e2e_pool):
    for mod in ("speculators", "specforge"):
        pytest.importorskip(mod)
    return e2e_pool.get(2)


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> list[str]:
    """Real fixture chats: OpenAI multi-turn threads, Alpaca, MT-Bench questions (user turns
    only), a ShareGPT tool-call conversation (ends at its unpaired call)."""
    need_fixtures()
    d = tmp_path_factory.mktemp("regen-inputs")
    threads = (CHAT / "oasst" / "threads.messages.jsonl").read_text().splitlines()
    (d / "threads.jsonl").write_text("\n".join(threads[:6]) + "\n")
    alpaca = json.loads((CHAT / "llamafactory" / "alpaca_en_demo.json").read_text())[:4]
    (d / "alpaca.json").write_text(json.dumps(alpaca))
    questions = (CHAT / "mt_bench" / "question.jsonl").read_text().splitlines()[:3]
    (d / "question.jsonl").write_text("\n".join(questions) + "\n")
    tools = json.loads((CHAT / "llamafactory" / "glaive_toolcall_en_demo.json").read_text())
    with_call = [r for r in tools if any(t["from"] == "function_call" for t in r["conversations"])
                 and len(r.get("tools") or "") < 1200][:2]  # stories serves 512 tokens
    (d / "glaive.json").write_text(json.dumps(with_call))
    return [str(d / n) for n in ("threads.jsonl", "alpaca.json", "question.jsonl", "glaive.json")]


def regen_argv(servers, chats, out: Path, *extra: str) -> list[str]:
    argv = [*HSX, "regenerate", "--output", str(out), "--max-tokens", str(MAX_TOKENS), "--json", "--quiet"]
    for s in servers:
        argv += ["--server", s.url]
    for c in chats:
        argv += ["--input", c]
    return argv + list(extra)


def run_regen(argv: list[str], timeout: float = 300) -> tuple[int, dict, str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=cli_env())
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    return r.returncode, json.loads(lines[0]) if lines else {}, r.stderr


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_regenerate_then_extract_masks_exactly_the_generated_tokens(servers, chats, tmp_path):
    out, corpus = tmp_path / "regen.jsonl", tmp_path / "speculators"
    rc, summary, err = run_regen(regen_argv(servers, chats, out, "--extract-to", str(corpus), "--two-pass", "--",
                                            "--format", "speculators", "--no-shuffle", "--json", "--quiet"))
    assert rc == 0, err[-3000:]
    assert summary["complete"] and summary["failed"] == 0 and summary["regenerated"] == 15
    regen = rows(out)
    assert summary["ended"] == {"complete": 13, "unpaired_tool_calls": 2}  # glaive's calls have no structured pair
    assert any(len(r["hsx_turns"]) > 1 for r in regen)
    assert summary["length_cut_turns"] == sum(t["finish_reason"] == "length" for r in regen for t in r["hsx_turns"])
    mtbench = [r for r in regen if r["hsx_regenerated"]["key"].startswith("question.jsonl")]
    assert all(len(r["hsx_turns"]) >= 1 and r["messages"][1]["role"] == "assistant" for r in mtbench)
    for r in regen:  # the model's own replies are the next turns' context
        assistants = [m for m in r["messages"] if m["role"] == "assistant"]
        assert len(assistants) == len(r["hsx_turns"])
        assert r["hsx_regenerated"]["ended"] != "length"  # a cut turn is flagged, and the chat goes on
        for k in range(1, len(r["hsx_turns"])):
            prev = r["hsx_turns"][k - 1]
            assert len(r["hsx_turns"][k]["prompt_token_ids"]) > len(prev["prompt_token_ids"])

    from _e2e_helpers import speculators_rows, stored_keys_by_row

    want = {f"{out.name}:{line}:t{k}": t for line, r in enumerate(regen, 1) for k, t in enumerate(
        [t for t in r["hsx_turns"] if t["token_ids"]], 1)}
    got = speculators_rows(corpus)
    keys = stored_keys_by_row(corpus)
    assert len(got) == len(want)
    for row, key in zip(got, keys):
        turn = want[key]
        ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
        assert ids == turn["prompt_token_ids"] + turn["token_ids"]
        assert [t for t, m in zip(ids, mask) if m] == turn["token_ids"]
        assert mask == [0] * len(turn["prompt_token_ids"]) + [1] * len(turn["token_ids"])
    from hsx_client.corpus.inputs import read_samples

    check_speculators_corpus(corpus, {s.key: s.request for s in read_samples([str(out)])}, MAX_LENGTH, "left")

    # SpecForge: every turn of a conversation in one row, token-exact from the same file
    sf = tmp_path / "specforge"
    run_extract(servers, sf, "--input", str(out), "--format", "specforge", "--mask-policy", "all_turns",
                "--no-shuffle")
    reqs = {s.key: s.request for s in read_samples([str(out)], mask_policy="all_turns")}
    for line, r in enumerate(regen, 1):
        req = reqs[f"{out.name}:{line}:all"]
        last = r["hsx_turns"][-1]
        assert req["input_ids"] == last["prompt_token_ids"] + last["token_ids"]
        assert req["input_ids"][-len(last["token_ids"]):] == last["token_ids"]
    check_specforge_corpus(sf, reqs, MAX_LENGTH, "right")


def test_sigkill_then_rerun_gives_the_identical_file(servers, chats, tmp_path):
    whole = tmp_path / "whole.jsonl"
    rc, _, err = run_regen(regen_argv(servers[:1], chats, whole, "--concurrency-per-server", "2"))
    assert rc == 0, err[-3000:]
    out = tmp_path / "killed.jsonl"
    argv = regen_argv(servers[:1], chats, out, "--concurrency-per-server", "2")
    journal = out.with_name(out.name + ".hsx-regen") / "journal.jsonl"
    proc = subprocess.Popen(argv, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (journal.exists() and journal.read_bytes().count(b"\n") >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "killed before the end: the output is written only whole"
    with open(journal, "ab") as fh:  # a torn last line, as a kill mid-write leaves
        fh.write(b'{"key": "threads.jsonl:1", "row": {"mess')
    rc, summary, err = run_regen(argv)
    assert rc == 0, err[-3000:]
    assert 3 <= summary["done_before"] < summary["planned"]
    assert out.read_bytes() == whole.read_bytes()
    rc, summary, _ = run_regen(argv)  # a finished run reruns as a no-op with the same file
    assert rc == 0 and summary["regenerated"] == 0 and out.read_bytes() == whole.read_bytes()
    rc, summary, _ = run_regen(regen_argv(servers[:1], chats, out, "--temperature", "0.7"))
    assert rc == 2 and "other settings" in summary["error"]


def test_bad_input_is_refused_with_a_clear_error(servers, tmp_path):
    pre = tmp_path / "pretokenized.jsonl"
    pre.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    rc, summary, _ = run_regen(regen_argv(servers[:1], [str(pre)], tmp_path / "a.jsonl"))
    assert rc == 2 and "no usable conversation" in summary["error"] and "pretokenized" in summary["error"]
    rc, summary, _ = run_regen(regen_argv(servers[:1], [str(tmp_path / "missing.jsonl")], tmp_path / "b.jsonl"))
    assert rc == 2 and "not found" in summary["error"]


def test_mix_assigns_each_conversation_its_variant_and_sends_its_settings(servers, chats, tmp_path):
    """--mix: the variant drawn from the key (and --seed), recorded in the row; its max_tokens
    and chat_template_kwargs are what hsx serve got (the short variant's turns are cut at
    its limit; a template switch off hsx serve's allow-list comes back refused)."""
    from hsx_client.regenerate.mix import load_mix, pick

    mix = json.dumps([{"name": "short", "weight": 1, "max_tokens": 3, "chat_template_kwargs": {"enable_thinking": False}},
                      {"name": "long", "weight": 1, "temperature": 0.8, "reasoning_effort": "high"}])
    out = tmp_path / "mixed.jsonl"
    argv = regen_argv(servers[:1], chats[:2], out, "--mix", mix)  # (no --seed: vLLM's CPU worker refuses seeds)
    rc, summary, err = run_regen(argv)
    assert rc == 0, err[-3000:]
    regen = rows(out)
    variants = load_mix(mix)
    names = [r["hsx_regenerated"]["variant"] for r in regen]
    assert names == [pick(variants, None, r["hsx_regenerated"]["key"]).name for r in regen]
    assert set(names) == {"short", "long"} and summary["variants"] == dict(Counter(names))
    for r in regen:
        limit = 3 if r["hsx_regenerated"]["variant"] == "short" else MAX_TOKENS
        assert r["hsx_regenerated"]["sampling"]["max_tokens"] == limit
        for t in r["hsx_turns"]:
            assert len(t["token_ids"]) <= limit and (t["finish_reason"] != "length" or len(t["token_ids"]) == limit)
    assert any(t["finish_reason"] == "length" and len(t["token_ids"]) == 3 for r in regen for t in r["hsx_turns"])
    rc, summary, _ = run_regen(argv[:-1] + [mix.replace("high", "low")])  # another mix: not this plan
    assert rc == 2 and "other settings" in summary["error"]

    bad = json.dumps([{"name": "bad", "chat_template_kwargs": {"tokenize": True}}])
    rc, summary, _ = run_regen(regen_argv(servers[:1], chats[:1], tmp_path / "bad.jsonl", "--mix", bad))
    assert rc == 2 and "refuses this run's sampling settings" in summary["error"], summary  # by the pre-flight


def test_the_readme_s_seeded_command_is_refused_by_the_pre_flight_on_cpu(servers, chats, tmp_path):
    """Issue 36.7: `--seed 1 --temperature 0.6` against a CPU server had every request
    refused, exit 1, an empty output and the refused settings locked into the plan. Now: one
    line before any work, exit 2, and the same --output takes other settings."""
    out = tmp_path / "seeded.jsonl"
    argv = [a for a in regen_argv(servers[:1], chats[:1], out, "--temperature", "0.6", "--seed", "1") if a != "--json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=cli_env())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert "seed is not available on vLLM's CPU backend" in lines[0] and "--seed 1" in lines[0], lines
    assert not out.exists()
    rc, summary, err = run_regen(regen_argv(servers[:1], chats[:1], out, "--temperature", "0.6"))
    assert rc == 0 and summary["in_output"]["rows"] == summary["planned"], err[-3000:]
