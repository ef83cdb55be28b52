"""Issue 3 end to end: `hsx extract` / `hsx verify` as subprocesses against real `hsx serve`
processes (vLLM CPU, the trained stories260K in fp32, layers 1,2,4,5, llama3 chat template).

What is proven here, with no mocks:
- every input format (OpenAI messages, ShareGPT with tools, Alpaca, MT-Bench, plain prompts,
  pre-tokenized ids + mask, a Hugging Face dataset dir) becomes a corpus in both formats that
  the trainers' own readers load completely (speculators 0.9 ArrowDataset with
  on_missing="raise"; SpecForge 0.2's offline reader + LocalFeatureStore + normalizer +
  collator), whose token ids are what the chat template renders, whose masks supervise the
  assistant turns only, and whose states equal transformers' (post-norm for SpecForge);
- SIGKILL of the client at several points, then resume: every sample exactly once;
- `hsx verify` finds a truncated and a corrupted sample file, and a resume redoes them;
- Ctrl-C: exit 130, resumable;
- two servers, one SIGKILLed mid-run: the run finishes on the other, nothing lost.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hsx_client.corpus.verify import verify_corpus
from conftest import need_fixtures
from _e2e_helpers import (
    LAYERS,
    CliProcess,
    assert_each_index_once,
    assert_verify_ok,
    check_specforge_corpus,
    check_speculators_corpus,
    extract_argv,
    plan_keys,
    run_extract,
    stored_indices,
    tokenizer,
    verify,
    wait_for_manifest,
)
from _server import CHAT

pytestmark = [pytest.mark.engine, pytest.mark.fixtures, pytest.mark.slow]

MAX_LENGTH = 384  # stories260K serves 512 tokens; real threads are longer
# speculators: one sample per assistant turn, keep the end (the supervised turn);
# SpecForge: every assistant turn in one sample, keep the start.
FORMATS = {
    "speculators": ("per_turn", "left"),
    "specforge": ("all_turns", "right"),
}


@pytest.fixture(scope="module")
def pool(e2e_pool):
    for mod, why in (("speculators", "speculators 0.9"), ("specforge", "specforge 0.2")):
        pytest.importorskip(mod, reason=f"{why} is not installed (the trainers' readers)")
    return e2e_pool  # the failover test kills one, `get` starts a fresh one


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, list[str]]:
    """Input files per format: the real fixture files, and three built from them."""
    need_fixtures()
    d = tmp_path_factory.mktemp("e2e-inputs")
    tok = tokenizer()
    alpaca = json.loads((CHAT / "llamafactory" / "alpaca_en_demo.json").read_text())
    questions = [json.loads(x) for x in (CHAT / "mt_bench" / "question.jsonl").read_text().splitlines() if x.strip()]

    with open(d / "prompts.jsonl", "w") as f:  # plain prompts, both spellings
        for q in questions[:10]:
            f.write(json.dumps({"prompt": q["turns"][0]}) + "\n")
        for row in alpaca[:10]:
            f.write(json.dumps({"text": row["instruction"] + "\n" + row["output"]}) + "\n")

    with open(d / "pretokenized.jsonl", "w") as f:  # context masked out, answer supervised
        for row in alpaca[20:40]:
            ctx = [tok.bos_token_id] + tok(row["instruction"], add_special_tokens=False)["input_ids"]
            ans = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            f.write(json.dumps({"input_ids": ctx + ans, "loss_mask": [0] * len(ctx) + [1] * len(ans)}) + "\n")

    import datasets

    threads = [json.loads(x) for x in (CHAT / "oasst" / "threads.messages.jsonl").read_text().splitlines()[300:340]]
    datasets.Dataset.from_list(threads).save_to_disk(str(d / "oasst_hf"))

    return {
        "openai": [str(CHAT / "oasst" / "threads.messages.jsonl")],
        "sharegpt": [str(CHAT / "llamafactory" / "glaive_toolcall_en_demo.json")],
        "alpaca": [str(CHAT / "llamafactory" / "alpaca_en_demo.json")],
        "mtbench": [str(CHAT / "mt_bench" / "question.jsonl"),
                    str(CHAT / "mt_bench" / "llama-2-chat-70b-fp16-base-in-temperature-0.0.jsonl")],
        "prompts": [str(d / "prompts.jsonl")],
        "pretokenized": [str(d / "pretokenized.jsonl")],
        "hf_dir": [str(d / "oasst_hf")],
    }


def requests_for(paths: list[str], policy: str) -> dict[str, dict]:
    from hsx_client.corpus.inputs import read_samples

    return {s.key: s.request for s in read_samples(paths, mask_policy=policy)}


def input_args(paths: list[str]) -> list[str]:
    return [a for p in paths for a in ("--input", p)]


def check_corpus(out: Path, fmt: str, paths: list[str]) -> int:
    policy, side = FORMATS[fmt]
    reqs = requests_for(paths, policy)
    if fmt == "speculators":
        return check_speculators_corpus(out, reqs, MAX_LENGTH, side)
    return check_specforge_corpus(out, reqs, MAX_LENGTH, side)


def fmt_args(fmt: str, paths: list[str], n: int, *extra: str) -> list[str]:
    policy, side = FORMATS[fmt]
    return ["--format", fmt, "--mask-policy", policy, "--max-length", str(MAX_LENGTH), "--truncation", side,
            "--max-samples", str(n), *input_args(paths), *extra]


# ----------------------------------------------------------------------------- every input format


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["openai", "sharegpt", "alpaca", "mtbench", "prompts", "pretokenized", "hf_dir"])
def test_input_format_to_corpus_read_by_trainer(pool, inputs, tmp_path, kind, fmt):
    """Real rows of each input format -> a corpus the trainer's own reader loads completely,
    with the rendered token ids, assistant-only masks and transformers' states."""
    n = 8
    out = tmp_path / "corpus"
    summary = run_extract(pool.get(2), out, *fmt_args(fmt, inputs[kind], n))
    # rows that truncation leaves with no supervised token are dropped (nothing to train on)
    stored = n - summary["dropped"]
    assert summary["status"] == "complete" and summary["done"] == stored and summary["failed"] == 0
    assert stored > 0
    keys = plan_keys(out)
    assert len(keys) == n
    if kind in ("sharegpt", "alpaca", "mtbench", "openai", "hf_dir"):
        suffix = ":all" if fmt == "specforge" else ":t"
        assert all(suffix in k for k in keys), keys
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert corpus["layer_ids"] == LAYERS and corpus["format"] == fmt and corpus["last_layer_pre_norm"] is True
    assert corpus["mask_policy"] == FORMATS[fmt][0] and corpus["max_length"] == MAX_LENGTH
    assert corpus["counts"]["done"] == stored and corpus["versions"]["vllm"]
    assert corpus["chat_template_sha256"]
    report = verify_corpus(out)  # `hsx verify` in-process (the CLI is run by the tests below)
    assert report["ok"] and report["done"] == stored and not report["bad"], report
    assert check_corpus(out, fmt, inputs[kind]) == stored


# ----------------------------------------------------------------------------- client killed


def test_client_sigkill_at_several_points_then_resume(pool, inputs, tmp_path):
    """SIGKILL after the first stored sample, after about half, and once more at the end
    (finalize, when it is still running); each resume re-does only what is missing."""
    n = 36
    out = tmp_path / "corpus"
    argv = extract_argv(pool.get(2), out, *fmt_args("speculators", inputs["openai"], n,
                                                   "--concurrency-per-server", "1", "--seed", "7"))
    seen = []
    for target in (1, n // 2):
        cp = CliProcess(argv, tmp_path / "extract.log")
        wait_for_manifest(cp, out, target)
        rc = cp.kill()
        assert rc == -signal.SIGKILL, f"extract was not running at the kill point ({rc})"
        stored = len(set(stored_indices(out)))
        assert stored < n, "the run finished before the kill"
        seen.append(stored)
        assert (out / "plan.json").exists() and not (out / "hsx_corpus.json").exists()
        report = verify_corpus(out)  # incomplete but sound: nothing bad, just missing
        assert not report["ok"] and report["bad_samples"] == 0 and report["missing"] == n - stored
    assert seen[0] < seen[1]

    # the last attempt: kill once every sample is recorded (finalize may be running)
    cp = CliProcess(argv, tmp_path / "extract.log")
    wait_for_manifest(cp, out, n)
    cp.kill()
    # resume with only the output and a server: the plan supplies the rest
    summary = run_extract(pool.get(1), out, "--resume")
    assert summary["status"] == "complete" and summary["done"] == n
    assert_each_index_once(out, n)
    assert_verify_ok(out)
    assert check_corpus(out, "speculators", inputs["openai"]) == n


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_verify_detects_broken_files_and_resume_redoes_them(pool, inputs, tmp_path, fmt):
    """A truncated file and a same-size corrupted file: `hsx verify` exits non-zero naming
    both samples; the next extract redoes exactly those; verify then passes."""
    n = 12
    out = tmp_path / "corpus"
    args = fmt_args(fmt, inputs["sharegpt"], n)
    run_extract(pool.get(2), out, *args)
    assert_verify_ok(out)
    keys = plan_keys(out)
    path = (lambda i: out / f"hidden_states/hs_{i}.safetensors") if fmt == "speculators" else \
        (lambda i: out / f"rows/{i // 1000:04d}/data_{i}.ckpt")
    truncated, corrupted = 3, 8
    p = path(truncated)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    p = path(corrupted)
    data = bytearray(p.read_bytes())
    for j in range(len(data) - 200, len(data) - 100):  # tensor bytes, same size
        data[j] ^= 0x5A
    p.write_bytes(bytes(data))

    rc, report, err = verify(out)
    assert rc == 1 and not report["ok"]
    assert sorted(b["index"] for b in report["bad"]) == [truncated, corrupted]
    for i in (truncated, corrupted):
        assert f"BAD {i} ({keys[i]})" in err, err
    assert (out / "verify.json").exists()

    before = len(stored_indices(out))
    summary = run_extract(pool.get(2), out)  # the same command minus flags: the plan's settings
    assert summary["status"] == "complete" and summary["samples_this_run"] == 2
    lines = stored_indices(out)
    assert len(lines) == before + 2 and sorted(lines[-2:]) == [truncated, corrupted]
    assert not (out / "verify.json").exists()
    assert_verify_ok(out)
    assert check_corpus(out, fmt, inputs["sharegpt"]) == n


def test_ctrl_c_exits_130_and_resumes(pool, inputs, tmp_path):
    """SIGINT: the client finishes the stores in progress and exits 130; nothing stored is
    broken, and rerunning the command completes the corpus."""
    n = 30
    out = tmp_path / "corpus"
    argv = extract_argv(pool.get(1), out, *fmt_args("specforge", inputs["alpaca"], n,
                                                   "--concurrency-per-server", "1"))
    cp = CliProcess(argv, tmp_path / "extract.log")
    wait_for_manifest(cp, out, 3)
    cp.proc.send_signal(signal.SIGINT)
    rc = cp.wait(60)
    assert rc == 130, cp.output()[-2000:]
    assert "interrupted" in cp.output()
    stored = set(stored_indices(out))
    assert len(stored) < n, "the run finished before the interrupt"
    assert (out / "plan.json").exists() and not (out / "hsx_corpus.json").exists()
    rc_v, report, err = verify(out)  # `hsx verify`: incomplete (exit 1) but nothing broken
    assert rc_v == 1 and report["bad_samples"] == 0 and report["missing"] == n - len(stored), err

    summary = run_extract(pool.get(1), out, "--resume", *fmt_args("specforge", inputs["alpaca"], n))
    assert summary["status"] == "complete" and summary["samples_this_run"] == n - len(stored)
    assert_each_index_once(out, n)
    assert_verify_ok(out)
    assert check_corpus(out, "specforge", inputs["alpaca"]) == n


# ----------------------------------------------------------------------------- a server killed (the pool replaces it)


def test_server_killed_mid_run_fails_over(pool, inputs, tmp_path):
    """Two servers; one is SIGKILLed (its whole process group, engine included) while the
    run is going: requests fail over to the other and every planned sample is stored once."""
    n = 60
    out = tmp_path / "corpus"
    a, b = pool.get(2)
    argv = extract_argv([a, b], out, "--json", *fmt_args("speculators", inputs["mtbench"], n,
                                                         "--concurrency-per-server", "2"))
    cp = CliProcess(argv, tmp_path / "extract.log")
    wait_for_manifest(cp, out, 4)
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(30)
    at_kill = len(set(stored_indices(out)))
    assert cp.proc.poll() is None and at_kill < n, "the run finished before the server was killed"
    rc = cp.wait(240)
    text = cp.output()
    assert rc == 0, text[-3000:]
    summary = json.loads(cp.stdout())
    assert summary["status"] == "complete" and summary["done"] == n and summary["failed"] == 0
    servers = summary["servers"]
    assert servers[b.url]["ok"] >= n - at_kill, servers
    assert servers[a.url]["errors"] >= 1 and not servers[a.url]["healthy"], servers
    assert_each_index_once(out, n)
    assert_verify_ok(out)
    assert check_corpus(out, "speculators", inputs["mtbench"]) == n
