"""`hsx bench` short CI mode: the three modes end to end on CPU, a well-formed result.

No timing assertions: only that every mode ran, measured something, and that the
byte counts and the corpus of (c) are what the prompts imply.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

@pytest.mark.engine
@pytest.mark.slow
def test_bench_quick_three_modes(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install '.[cpu]' for the benchmark)")
    out = tmp_path / "bench.json"
    prompts, length = 16, 128
    cmd = [
        sys.executable, "-m", "hsx_tools.cli", "bench", "--quick",
        "--prompts", str(prompts), "--prompt-len", str(length), "--concurrency", "4", "--warmup", "2",
        "--workdir", str(tmp_path / "work"), "--out", str(out), "--transfer", "auto,http", "--rss-soak", "1",
        "--codec", "bf16split", "--client-process",  # the remote path's coding; the client in its own tree
        "--workers", "2",  # ... receiving and storing in two worker processes (hsx extract --workers)
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"hsx bench failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "(c) hsx end to end" in proc.stdout  # the table was printed

    r = json.loads(out.read_text())
    assert set(r["modes"]) == {"a", "b", "c"}
    assert r["prompts"] == {"count": prompts, "length": length, "seed": 0, "warmup": 2}
    layers, hidden = r["layers"], r["model"]["hidden_size"]
    assert len(layers) == 4 and hidden == 128 and r["itemsize"] == 2
    tokens = prompts * length
    per_token = len(layers) * hidden * 2
    for m in ("a", "b", "c"):
        d = r["modes"][m]
        assert d["tokens"] == tokens, m
        assert d["tokens_per_s"] > 0 and d["measured_s"] > 0 and d["gb_per_s"] > 0, m
        assert d["hs_bytes"] == tokens * per_token, m
        assert d["engine_memory"]["peak_rss_sum"] > 0, m
    b, c = r["modes"]["b"], r["modes"]["c"]
    assert b["requests"] == prompts and b["file_bytes"] > b["hs_bytes"]
    assert 0 < b["engine_tokens_per_s"]
    # (c): every sample stored and the corpus opens; the headline through same-host leases
    # (a few KB on the wire per request), then HTTP bodies zstd-coded, on the same server
    assert c["requests"] == prompts and c["transfer"] == "auto"
    assert 0 < c["wire_bytes"] < 0.2 * c["hs_bytes"] and c["body_bytes"] > c["hs_bytes"]
    http = c["by_transfer"]["http"]
    assert http["requests"] == prompts and 0.3 * http["hs_bytes"] < http["wire_bytes"] < http["body_bytes"]
    assert http["corpus"]["ok"] and http["tokens_per_s"] > 0
    assert http["client_process"] and r["client_process"] and r["workers"] == 2
    cm = http["client_memory"]  # the client's memory is the parent and its two workers, not the parent alone
    assert cm["tree"]["processes"] >= 3 and cm["peak_rss"] >= cm["parent_peak_rss"] > 0
    prof = http["client_profile"]
    # a streamed sample is parsed as it is received: no separate decode phase (decode_s 0)
    assert prof["receive_s"] > 0 and prof["decode_s"] >= 0 and prof["store_s"] > 0
    assert prof["response_s"] > 0 and prof["implied_life_s"] > 0
    # a sample's life holds its request and its storing (the workers' books reached the bench)
    assert prof["life_s"] >= prof["response_s"] + prof["receive_s"] + prof["store_s"]
    assert http["server_phases"]["compress"]["count"] == prompts  # bf16split bodies were coded on the pool
    assert http["server_phases"]["wait"]["count"] == prompts and http["server_phases"]["loop_lag"]["count"] > 0
    assert "(c) HTTP profile [http, bf16split], mean s per request: server" in proc.stdout
    assert c["server_lease_only"]["leased"] == prompts and c["server_http_only"]["tokens_per_s"] > 0
    assert c["soak"]["requests"] == prompts and c["soak"]["transfer"] == "lease"
    assert set(c["soak"]["points"]) == {"before", "10%", "50%", "100%"}
    assert c["finalize_s"] is not None and c["client_memory"]["peak_rss"] > 0
    assert c["corpus"]["ok"] and c["corpus"]["rows"] == prompts and c["corpus"]["files"] == prompts
    assert c["corpus"]["disk_bytes"] >= c["hs_bytes"]
    for k in ("c_over_a", "c_over_b", "b_over_a"):
        assert r["ratios"][k] is not None and r["ratios"][k] > 0
    assert r["versions"].get("vllm") and r["hardware"]["cpu_count"] >= r["hardware"]["usable_cores"] >= 1


def test_codec_candidates_round_trip() -> None:
    """Every codec candidate is bit-exact on bf16 data (fast; no engine)."""
    from hsx_tools.bench.codec import choose_codec, entropy_bound, measure_codecs

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(300_000) * 3).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation to bf16 bits
    rows = measure_codecs(bf16.tobytes(), dtype="bfloat16", repeat=1, label="gauss")
    assert {r["codec"] for r in rows} >= {"none (copy)", "zstd 1", "zstd 1 threads=2", "bf16 exp-plane zstd1 hl6"}
    assert all(r["bit_exact"] for r in rows)
    split = next(r for r in rows if r["codec"] == "bf16 exp-plane zstd1 hl6")
    assert split["ratio"] > 1.2
    assert split["ratio"] <= entropy_bound(bf16.tobytes())["ratio_limit"] * 1.02
    assert choose_codec(rows, target_MBps_per_core=0.0)["pick"] is not None


@pytest.mark.slow  # six client processes and a server: ~15 s on a loaded 2-core box
def test_transport_study_runs_each_client(tmp_path: Path) -> None:
    """`hsx bench --transport-only`, tiny: every client reads every byte of identity and
    zstd (chunked) bodies, ratios against httpx's default (no timing assertion)."""
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "hsx_tools.cli", "bench", "--transport-only", "--body-mb", "2",
                           "--requests", "3", "--concurrency", "2", "--repeat", "1", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(c["encoding"], c["body_mb"], c["concurrency"]) for c in res["cells"]] == [("identity", 2, 2), ("zstd", 2, 2)]
    for cell in res["cells"]:
        rows = cell["rows"]
        assert [r["client"] for r in rows] == ["httpx", "aiohttp", "httpx_aiohttp"]
        wire = rows[0]["bytes"]
        assert all(r["bytes"] == wire and r["cpu_s_per_gb"] > 0 and r["cpu_vs_httpx"] > 0 for r in rows)
    assert res["cells"][0]["rows"][0]["bytes"] == 3 * (2 << 20)  # identity: the body itself
    assert 0 < res["cells"][1]["rows"][0]["bytes"] < 3 * (2 << 20)  # zstd: smaller on the wire
    assert set(res["summary"]["cpu_vs_httpx_geomean"]) == {"httpx", "aiohttp", "httpx_aiohttp"}
    assert res["summary"]["cheapest"] in {"httpx", "aiohttp", "httpx_aiohttp"}


def test_tree_sampler_leaves_out_excluded_subtrees() -> None:
    """The client's memory with --workers: this process and its workers, not the server
    subtree it started (fast; real child processes)."""
    from hsx_tools.bench.memory import TreeSampler

    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    spawn_grandchild = [sys.executable, "-c",
                        f"import subprocess, time; subprocess.Popen({sleep!r}); time.sleep(30)"]
    worker = subprocess.Popen(sleep)
    server = subprocess.Popen(spawn_grandchild)
    try:
        for _ in range(100):  # the "server" has started its own child
            if psutil.Process(server.pid).children():
                break
            time.sleep(0.05)
        everyone = {p.pid for p in TreeSampler(os.getpid())._tree()}
        client = {p.pid for p in TreeSampler(os.getpid(), exclude=(server.pid,))._tree()}
        grandchild = psutil.Process(server.pid).children()[0].pid
        assert {os.getpid(), worker.pid, server.pid, grandchild} <= everyone
        assert os.getpid() in client and worker.pid in client
        assert server.pid not in client and grandchild not in client
    finally:
        for p in (worker, server):
            for c in psutil.Process(p.pid).children(recursive=True):
                c.kill()
            p.kill()
            p.wait()


def test_http_profile_line_splits_a_sample_s_life() -> None:
    """The report's HTTP profile: server phases, then the client's life of a sample split
    into its phases, the rest, and the life Little's law implies (old results lack some)."""
    from hsx_tools.bench.report import _http_profile

    one = {"compression": "zstd",
           "server_phases": {"engine": {"mean_s": 0.5}, "compress": {"mean_s": 0.1}, "send": {"mean_s": 0.3}},
           "client_profile": {"response_s": 1.0, "receive_s": 0.25, "decode_s": 0.125, "store_s": 0.125,
                              "life_s": 2.0, "implied_life_s": 4.0, "concurrency": 64}}
    line = _http_profile("http", one)
    assert "server engine 0.500, compress 0.100, send 0.300, wire (send - coding) 0.200" in line
    assert ("client to headers 1.000, receive 0.250, decode 0.125, store 0.125, other 0.500 of a life of "
            "2.000 (at 64 in flight, Little's law: 4.000)") in line
    old = {"client_profile": {"receive_s": 0.25, "decode_s": 0.125, "store_s": 0.125, "concurrency": 8}}
    assert _http_profile("http", old).endswith("client receive 0.250, decode 0.125, store 0.125 (at 8 in flight)")


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "bench").glob("*.py")))
def test_bench_scripts_start(script: str) -> None:
    """Every rerunnable script under bench/ still imports what it uses (shard_merge.py had
    kept imports from before hsx_tools.bench was split into modules) and prints its usage."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stderr[-2000:]


@pytest.mark.engine
def test_lease_only_profile_walks_a_chunked_sample_unread(chunk_server):
    """hsx bench's "server + leases alone" arm on a sample larger than the stream window: its
    chunk leases are walked and released unread (the sample is never collected), one request
    at a time as `--concurrency 1` sends them."""
    import asyncio

    from conftest import WIDE_TOKENS, WIDE_VOCAB
    from hsx_tools.bench.mode_c import _fire

    prompt = [int(x) for x in np.random.default_rng(5).integers(3, WIDE_VOCAB, WIDE_TOKENS - 8)]
    fired = asyncio.run(asyncio.wait_for(_fire(chunk_server.url, [prompt], 1, "none", lease=True), 240))
    assert fired["n"] == 1 and fired["leased"] == 1 and fired["wire"] < 1 << 20


@pytest.mark.engine
def test_lease_only_profile_reads_a_body_when_no_lease_is_offered(chunk_server, monkeypatch):
    """The same arm where the client cannot map the server's arena (another host, a container):
    the sample comes as an HTTP body, read and dropped, and counts as not leased."""
    import asyncio

    from conftest import WIDE_TOKENS, WIDE_VOCAB
    from hsx_client import shm
    from hsx_tools.bench.mode_c import _fire

    def no_arena(offer, key):
        raise shm.ShmUnavailable("the server runs on another host")

    monkeypatch.setattr(shm, "attach", no_arena)
    prompt = [int(x) for x in np.random.default_rng(6).integers(3, WIDE_VOCAB, WIDE_TOKENS - 8)]
    fired = asyncio.run(asyncio.wait_for(_fire(chunk_server.url, [prompt], 1, "none", lease=True), 240))
    states = (WIDE_TOKENS - 8) * 4 * 2048 * 4
    assert fired["n"] == 1 and fired["leased"] == 0 and fired["body"] == states and fired["wire"] > states


def test_image_chat_workload_makes_chats_hsx_takes() -> None:
    """The image-chat workload's chats (tools/bench/image_chat.py): 1 to 3 real images each,
    of several sizes and both formats, every one within hsx's default media limits."""
    import base64
    import io

    from PIL import Image

    from hsx_service.media.limits import MediaLimits
    from hsx_tools.bench.image_chat import make_chats

    chats = make_chats(6, 0)
    assert make_chats(6, 0) == chats
    counts, sizes, formats = [], set(), set()
    for chat in chats:
        parts = [p for p in chat[1]["content"] if p["type"] == "image_url"]
        counts.append(len(parts))
        for p in parts:
            data = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
            im = Image.open(io.BytesIO(data))
            sizes.add(im.size)
            formats.add(im.format)
            assert len(data) < MediaLimits().max_image_bytes and im.size[0] * im.size[1] < MediaLimits().max_image_pixels
        assert chat[-1]["role"] == "assistant"
    assert counts == [1, 2, 3, 1, 2, 3] and len(sizes) >= 4 and formats == {"PNG", "JPEG"}


def test_image_chat_workload_redoes_a_chat_whose_lease_was_gone_and_counts_it() -> None:
    """A lease answered 410 at its release (issue 41's H100 run died of the first one): the chat
    is redone and counted, so that the run reports it with the server's lease outcomes."""
    import asyncio
    from types import SimpleNamespace

    import torch

    from hsx_client.errors import LeaseExpiredError
    from hsx_tools.bench.image_chat import LEASE_REDOS, _fire_with

    class Client:  # HsxClient's two calls the workload makes; the second release of chat 0 fails
        def __init__(self, gone: int) -> None:
            self.gone, self.posted, self.released = gone, [], 0

        async def hidden_states_response(self, body, lease_ok):
            self.posted.append(body["messages"])
            n = len(body["messages"])
            decoded = SimpleNamespace(token_ids=list(range(n)), hidden_states=torch.zeros(n, 2, 4),
                                      media_mask=torch.tensor([True] + [False] * (n - 1)))
            return SimpleNamespace(lease=object(), decode=lambda: decoded)

        async def release_lease(self, lease):
            self.released += 1
            if self.released <= self.gone:
                raise LeaseExpiredError("gone", status=410, type="lease_gone")

    chats = [[{"role": "user", "content": "a"}] * 3, [{"role": "user", "content": "b"}] * 5]
    client = Client(gone=1)
    got, redos = asyncio.run(_fire_with(client, chats, 1, "auto"))
    assert got == [(3, 1), (5, 1)] and redos == 1 and len(client.posted) == 3
    with pytest.raises(LeaseExpiredError):  # a lease that never holds fails the run, after the redos
        asyncio.run(_fire_with(Client(gone=99), chats[:1], 1, "auto"))
    assert LEASE_REDOS >= 1
