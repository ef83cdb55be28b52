"""Issue 29's chunked states through `--http-workers`, on a real engine.

A worker fetches each request's states as a lease from the engine process's arena; a sample
larger than the stream window comes as the chunked lease form (hsx/wire.py
LEASE_STREAM_MEDIA_TYPE), which the worker codes chunk by chunk, releasing each chunk's lease
once sent (service/http/http_worker.py). The fake-engine unit test
(test_http_workers.py) covers the form; this module runs it against vLLM: the session's
`wide_model` (hidden 2048, 4 layers, fp32) behind an 8 MiB arena (a 1 MiB window) and one
worker, so a 4096-token sample (128 MiB of states) is sent in many chunks. One server for the
module: `chunk_server`'s flags plus `--http-workers 1`; `chunk_server` (shared with
tests/service/test_chunked_states.py) answers the same sample without a worker.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from _e2e_helpers import HSX, assert_verify_ok, cli_env
from _server import ServerProcess, wait_until
from conftest import WIDE_ARENA, WIDE_TOKENS, WIDE_VOCAB, need_vllm
from hsx.wire import decode

pytestmark = pytest.mark.engine

TOKENS = WIDE_TOKENS
HIDDEN = 2048
LAYERS = 4  # the default ids of a 4-layer model: 1..4
STATES_BYTES = TOKENS * LAYERS * HIDDEN * 4


def _ids(seed: int, n: int = TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(1, WIDE_VOCAB, n).tolist()


@pytest.fixture(scope="module")
def worker_server(wide_model, log_dir):
    need_vllm()
    server = ServerProcess(str(wide_model), "--dtype", "float32", "--max-model-len", str(TOKENS + 64),
                           "--arena-bytes", str(WIDE_ARENA), "--max-num-seqs", "8", "--http-workers", "1",
                           "--no-enable-prefix-caching", log_dir=log_dir, name="chunked-workers")
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def direct(chunk_server):
    """The same sample from the session's `chunk_server` (the same model and flags, no worker:
    the engine process sends the body). Single fp32 requests on one machine are deterministic
    (measured: byte-equal, and equal to the transformers reference within fp32 noise as
    tests/service/test_chunked_states.py checks), so the worker's body must be byte-equal."""
    ids = _ids(0)
    r = httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": ids},
                   headers={"Accept-Encoding": "identity"}, timeout=300)
    assert r.status_code == 200, r.text[:300]
    return ids, decode(r.content).hidden_states.clone()


def _leases(server) -> dict[str, float]:
    m = server.metrics()
    return {o: m.get("hsx_leases_total", 0.0, outcome=o) for o in ("granted", "released", "unsent")}


def _all_freed(server) -> bool:
    m = server.metrics()
    return m.get("hsx_arena_used_bytes") == 0 and m.get("hsx_leases_live") == 0


def test_the_worker_serves_the_public_port(worker_server):
    assert worker_server.metrics().get("hsx_http_workers") == 1


@pytest.mark.parametrize("coding", ["identity", "zstd"])
def test_sample_larger_than_the_arena_is_exact_through_the_worker(worker_server, direct, coding):
    ids, ref = direct
    before = _leases(worker_server)
    r = httpx.post(worker_server.url + "/hidden_states", json={"input_ids": ids},
                   headers={"Accept-Encoding": coding}, timeout=300)
    assert r.status_code == 200, r.text[:300]
    assert r.headers.get("content-encoding", "identity") == coding
    got = decode(r.content)  # httpx decodes the zstd frame
    assert got.token_ids.tolist() == ids
    assert got.hidden_states.shape == (TOKENS, LAYERS, HIDDEN)
    assert torch.equal(got.hidden_states, ref)  # every chunk in its place, none sent twice
    wait_until(lambda: _all_freed(worker_server), 30, "every chunk lease released and the window freed")
    after = _leases(worker_server)
    delta = {o: after[o] - before[o] for o in after}
    # The worker took it as chunk leases (one per window-sized chunk), not as a body from the
    # engine process, and released each itself once sent: none ended by the engine process
    # while the worker could still be reading it (its range is then another request's).
    assert delta["granted"] > STATES_BYTES // (WIDE_ARENA // 8)
    assert delta == {"granted": delta["granted"], "released": delta["granted"], "unsent": 0}


def test_client_leaving_mid_sample_frees_arena_leases_and_blocks(worker_server):
    ids = _ids(2)
    with httpx.stream("POST", worker_server.url + "/hidden_states", json={"input_ids": ids},
                      headers={"Accept-Encoding": "identity"}, timeout=300) as r:
        assert r.status_code == 200
        got = 0
        for piece in r.iter_raw():
            got += len(piece)
            if got > 3 * WIDE_ARENA:
                break
    assert got < STATES_BYTES
    wait_until(lambda: _all_freed(worker_server), 60, "the window and the chunk leases freed after the client left")
    wait_until(lambda: worker_server.metrics().get("hsx_kv_cache_usage", 0.0) == 0.0, 60, "the KV blocks freed")
    r = httpx.post(worker_server.url + "/hidden_states", json={"input_ids": ids[:2000]}, timeout=300)
    assert r.status_code == 200
    assert decode(r.content).hidden_states.shape == (2000, LAYERS, HIDDEN)
    wait_until(lambda: _all_freed(worker_server), 30, "the next sample's window freed")


def test_budgeted_extract_through_the_worker_writes_a_verified_corpus(worker_server, tmp_path: Path):
    inputs = tmp_path / "long.jsonl"
    rng = np.random.default_rng(29)
    with open(inputs, "w") as f:
        for _ in range(2):
            ids = rng.integers(5, WIDE_VOCAB, TOKENS).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 16 + [1] * (TOKENS - 16)}) + "\n")
    out = tmp_path / "corpus"
    r = subprocess.run([*HSX, "extract", "--server", worker_server.url, "--output", str(out), "--input", str(inputs),
                        "--format", "speculators", "--max-length", str(TOKENS), "--transfer", "http",
                        "--workers", "1", "--quiet", "--json", "--max-buffer-bytes", str(16 << 20),
                        "--concurrency-per-server", "2"],
                       capture_output=True, text=True, timeout=600, env=cli_env())
    assert r.returncode == 0, f"hsx extract exited {r.returncode}\n{r.stderr[-3000:]}"
    report = assert_verify_ok(out)
    assert report.get("samples", 2) == 2
    wait_until(lambda: _all_freed(worker_server), 30, "every window freed")
