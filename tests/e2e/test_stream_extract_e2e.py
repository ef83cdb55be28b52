"""Issue 29, the client side, end to end: `hsx extract` with a memory budget far below one
sample writes each sample as its states arrive, exactly, within its memory.

The session's `chunk_server` (tests/conftest.py: a random Llama with hidden 2048, 4 layers,
fp32, an 8 MiB arena): a 4096-token sample is 4096 x 4 x 2048 x 4 B = 128 MiB of states, so
the server sends it in chunks too (over HTTP and as chunk leases), and the client's budget is
16 MiB. The client (a subprocess, so that the test runner's memory does not count) reports
its peak RSS over its RSS once its imports are done; the same run with the whole-sample
path (the format's streaming switched off in that subprocess only) is the comparison.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _e2e_helpers import CliProcess, assert_each_index_once, assert_verify_ok, cli_env, speculators_rows
from conftest import WIDE_TOKENS, WIDE_VOCAB

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TOKENS = WIDE_TOKENS
HIDDEN = 2048
LAYERS = 4  # the server's default ids of a 4-layer model: 1..4
SAMPLES = 2
BUDGET = 16 << 20
SAMPLE_BYTES = TOKENS * LAYERS * HIDDEN * 4  # 128 MiB

# The client under test: `hsx extract` in a process that reports its RSS (VmHWM: the peak)
# over the RSS after its imports. HSX_TEST_WHOLE=1 takes the whole-sample path (the fp8 variant's
# before issue 36.8).
RUNNER = r"""
import json, os, sys
import datasets, torch, speculators  # what the run imports anyway: not the run's growth
from hsx_client.corpus.cli import extract_main
from hsx_client.corpus.formats.speculators import SpeculatorsFormat
from hsx_client.corpus.formats.speculators_variants import SpeculatorsFp8Format
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
if os.environ.get("HSX_TEST_WHOLE") == "1":
    SpeculatorsFormat.streams = SpeculatorsFp8Format.streams = False
base = status("VmRSS:")
rc = extract_main(sys.argv[1:])
with open(os.environ["HSX_TEST_RSS"], "w") as f:
    json.dump({"rc": rc, "base": base, "peak": status("VmHWM:")}, f)
sys.exit(rc)
"""


@pytest.fixture
def big_server(chunk_server):
    return chunk_server


@pytest.fixture(scope="module")
def long_inputs(tmp_path_factory) -> Path:
    rng = np.random.default_rng(29)
    path = tmp_path_factory.mktemp("stream-inputs") / "long.jsonl"
    with open(path, "w") as f:
        for _ in range(SAMPLES):
            ids = rng.integers(5, WIDE_VOCAB, TOKENS).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 16 + [1] * (TOKENS - 16)}) + "\n")
    return path


def argv(server, out: Path, inputs: Path, *extra: str, transfer: str = "http", fmt: str = "speculators") -> list[str]:
    return ["--server", server.url, "--output", str(out), "--input", str(inputs), "--format", fmt,
            "--max-length", str(TOKENS), "--transfer", transfer, "--workers", "1", "--quiet", "--json",
            "--max-buffer-bytes", str(BUDGET), "--concurrency-per-server", "2", *extra]


def run_client(args: list[str], rss_file: Path, whole: bool = False) -> dict:
    env = {**cli_env(), "HSX_TEST_RSS": str(rss_file), "HSX_TEST_WHOLE": "1" if whole else "0"}
    r = subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"hsx extract exited {r.returncode}\n{r.stderr[-3000:]}"
    return json.loads(rss_file.read_text())


def whole_states(server, request: dict, with_norm: bool = False):
    from hsx_client.api import HsxClient

    async def go():
        async with HsxClient(server.url, transfer="http", compression="none") as client:
            d = await client.hidden_states(**request, max_length=TOKENS)
            states = d.hidden_states.clone()
            return (states, await client.final_norm()) if with_norm else states

    return asyncio.run(go())


@pytest.mark.parametrize("transfer", ["http", "auto"])  # auto: same host, so the server's chunk leases
def test_budget_below_one_sample_streams_exactly_within_its_memory(big_server, long_inputs, tmp_path, transfer):
    out = tmp_path / "corpus"
    rss = run_client(argv(big_server, out, long_inputs, transfer=transfer), tmp_path / "rss.json")
    growth = rss["peak"] - rss["base"]
    print(f"client peak RSS growth ({transfer}): streamed {growth / 2**20:.0f} MiB (budget {BUDGET >> 20} MiB); "
          f"one sample {SAMPLE_BYTES >> 20} MiB")
    # the states of one sample never sit in the client: well under one sample, and under a
    # few budgets (the budget, and what finalize reads: the ids, the arrow table)
    assert growth < 3 * BUDGET, growth
    whole_path = transfer == "http"  # the whole-sample comparison once (it costs a second run)
    if whole_path:
        whole = run_client(argv(big_server, tmp_path / "whole", long_inputs), tmp_path / "rss-whole.json", whole=True)
        whole_growth = whole["peak"] - whole["base"]
        print(f"whole samples: {whole_growth / 2**20:.0f} MiB")
        assert whole_growth > SAMPLE_BYTES  # the comparison holds whole samples (what this test guards)

    assert_each_index_once(out, SAMPLES)
    assert_verify_ok(out)
    rows = speculators_rows(out, max_len=TOKENS)  # speculators' own reader, on_missing="raise"
    assert len(rows) == SAMPLES
    from safetensors.torch import load_file

    requests = {tuple(r["input_ids"]): r for r in map(json.loads, long_inputs.read_text().splitlines())}
    for i in range(SAMPLES):
        f = load_file(str(out / f"hidden_states/hs_{i}.safetensors"))
        request = requests.pop(tuple(f["token_ids"].tolist()))  # each input row once
        # Another prefill of the same prompt (the engine's float noise: ~1e-6 apart on CPU);
        # that the stream writes the bytes it got, exactly, tests/client/corpus/test_stream_write.py
        # checks on identical bodies.
        want = whole_states(big_server, request)
        assert f["hidden_states"].shape == want.shape == (TOKENS, LAYERS, HIDDEN)
        torch.testing.assert_close(f["hidden_states"], want, rtol=1e-4, atol=1e-4)
        assert torch.equal(rows[i]["input_ids"], f["token_ids"])
    # the whole-path corpus: the same files but for that noise (same header, ids, size)
    for i in range(SAMPLES if whole_path else 0):
        a = load_file(str(out / f"hidden_states/hs_{i}.safetensors"))
        b = load_file(str(tmp_path / "whole" / f"hidden_states/hs_{i}.safetensors"))
        assert torch.equal(a["token_ids"], b["token_ids"])
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], rtol=1e-4, atol=1e-4)


def test_sigkill_mid_sample_leaves_no_partial_file_and_resumes(big_server, long_inputs, tmp_path):
    out = tmp_path / "corpus"
    cp = CliProcess([sys.executable, "-m", "hsx_tools.cli", "extract",
                     *argv(big_server, out, long_inputs, "--concurrency-per-server", "1")], tmp_path / "x.log")
    deadline = time.monotonic() + 300
    partial = None
    while time.monotonic() < deadline and partial is None:  # a sample's temporary file, part-written
        for p in out.glob("hidden_states/.*hsx-tmp-*"):
            try:
                if 0 < p.stat().st_size < SAMPLE_BYTES // 2:
                    partial = p
            except FileNotFoundError:
                pass
        assert cp.proc.poll() is None, cp.output()[-3000:]
        time.sleep(0.005)
    assert partial is not None, "never saw a sample half-written"
    assert cp.kill() == -signal.SIGKILL
    final = partial.name.split(".hsx-tmp-")[0].lstrip(".")
    assert not (partial.parent / final).exists(), "a partial sample is visible under its final name"
    stored = {json.loads(x)["index"] for x in (out / "manifest.jsonl").read_text().splitlines() if x.strip()}
    assert len(stored) < SAMPLES

    r = subprocess.run([sys.executable, "-m", "hsx_tools.cli", "extract", *argv(big_server, out, long_inputs)],
                       capture_output=True, text=True, timeout=600, env=cli_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert_each_index_once(out, SAMPLES)  # also: no temporary file left
    assert_verify_ok(out)
    assert len(speculators_rows(out, max_len=TOKENS)) == SAMPLES


def test_specforge_samples_stream_into_their_ckpt_files(big_server, long_inputs, tmp_path):
    """SpecForge's files are written as the states arrive too (a torch.save archive front to
    back, the final norm applied per chunk): SpecForge's own reader gets the states."""
    from _e2e_helpers import specforge_batches

    from hsx_client.postnorm import apply_final_norm

    one = tmp_path / "one.jsonl"
    one.write_text(long_inputs.read_text().splitlines()[0] + "\n")  # one sample proves it
    out = tmp_path / "corpus"
    r = subprocess.run([sys.executable, "-m", "hsx_tools.cli", "extract", *argv(big_server, out, one, fmt="specforge")],
                       capture_output=True, text=True, timeout=600, env=cli_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert_each_index_once(out, 1)
    assert_verify_ok(out)
    raw = torch.load(out / "rows/0000/data_0.ckpt", weights_only=True, mmap=True)
    # the streamed file's layout (the whole path saves each tensor in a storage of its own):
    # one storage of [T, 4H] rows, the normed last layer the last H of each row
    last, aux = raw["hidden_state"], raw["aux_hidden_state"]
    assert last.untyped_storage().data_ptr() == aux.untyped_storage().data_ptr()
    assert (last.storage_offset(), last.stride()) == (3 * HIDDEN, (TOKENS * 4 * HIDDEN, 4 * HIDDEN, 1))
    batches = specforge_batches(out, max_len=TOKENS)
    assert list(batches) == [0]
    request = json.loads(one.read_text())
    want, norm = whole_states(big_server, request, with_norm=True)  # another prefill: float noise apart
    b = batches[0]
    assert b["input_ids"][0].tolist() == request["input_ids"]
    torch.testing.assert_close(b["hidden_state"][0], want[:, :3].reshape(TOKENS, 3 * HIDDEN), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b["target"][0], apply_final_norm(want[:, 3], norm), rtol=1e-4, atol=1e-4)


def test_fp8_samples_stream_within_the_budget(big_server, long_inputs, tmp_path):
    """Issue 36.8: `--dtype fp8` samples are quantized chunk by chunk as they arrive (per-token
    scales), not held whole: the client grows by a few budgets, not by the sample; the file holds
    the states to fp8's precision."""
    one = tmp_path / "one.jsonl"
    one.write_text(long_inputs.read_text().splitlines()[0] + "\n")
    out = tmp_path / "corpus"
    rss = run_client(argv(big_server, out, one, "--dtype", "fp8"), tmp_path / "rss.json")
    growth = rss["peak"] - rss["base"]
    # The whole-sample path this replaced grew by several samples here; it is measured beside the
    # streamed one in tests/client/corpus/test_fp8_stream.py (and bench/fp8_stream_memory.py), not
    # again on this engine.
    print(f"client peak RSS growth, fp8 streamed: {growth / 2**20:.0f} MiB (budget {BUDGET >> 20} MiB); "
          f"one sample {SAMPLE_BYTES >> 20} MiB")
    # 4 budgets, not the other tests' 3: fp8 keeps two quantizing buffers (~5 MiB) per stream
    # beside the budget; still far below one sample.
    assert growth < 4 * BUDGET < SAMPLE_BYTES, growth

    assert_each_index_once(out, 1)
    assert_verify_ok(out)
    from safetensors.torch import load_file

    f = load_file(str(out / "hidden_states/hs_0.safetensors"))
    assert f["hidden_states"].dtype == torch.float8_e4m3fn and f["hidden_states"].shape == (TOKENS, LAYERS, HIDDEN)
    assert f["hidden_states_scales"].shape == (TOKENS, 1, 1)
    request = json.loads(one.read_text())
    assert f["token_ids"].tolist() == request["input_ids"]
    want = whole_states(big_server, request)  # another prefill: float noise apart, far below fp8's step
    got = f["hidden_states"].float() * f["hidden_states_scales"]
    err = ((got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))).max().item()
    assert err < 0.05, f"worst token's relative error {err}"

