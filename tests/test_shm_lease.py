"""Same-host transfer (service/lease.py, client/shm.py): states read from the server's
arena instead of an HTTP body, under a lease the client releases.

Unit tests on the real pieces (a tmpfs arena, the abstract Unix socket, descriptor
passing), then real `hsx serve` processes: values equal the HTTP body's, release and
expiry answers, the arena range coming back, a client whose lease expired redoing the
sample, socket auth, and a SIGTERM drain that waits for a held lease.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from _server import ServerProcess
from conftest import need_vllm
from hsx import wire
from hsx_client import shm
from hsx_client.api import HsxClient
from hsx_client.errors import LeaseExpiredError
from hsx_service.arena import SharedArena
from hsx_service.lease import ArenaSocket, Leases, boot_id

KEY = "lease-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------------------ units

async def test_leases_release_once_and_expire():
    ended: list[tuple[str, str]] = []
    leases = Leases(timeout=0.2)
    a = leases.grant(lambda outcome: ended.append(("a", outcome)))
    b = leases.grant(lambda outcome: ended.append(("b", outcome)))
    assert a != b and len(a) == 32 and len(leases) == 2
    assert leases.release(a) is True
    assert leases.release(a) is False  # a second release: the range may be someone else's now
    await asyncio.sleep(0.4)
    assert ended == [("a", "released"), ("b", "expired")]
    assert leases.release(b) is False and len(leases) == 0


@pytest.fixture
def arena(tmp_path):
    a = SharedArena.create(str(tmp_path), 1 << 20)
    yield a
    a.close()


def _offer(sock: ArenaSocket, arena: SharedArena) -> dict:
    return {"socket": sock.address, "arena_id": arena.arena_id, "boot_id": boot_id()}


def test_socket_hands_a_read_only_mapping_to_the_right_key(arena):
    arena.view[4096:4100] = b"hsx!"
    sock = ArenaSocket(arena.ro_fd, arena.arena_id, arena.size, [KEY]).start()
    try:
        mapped = shm.attach(_offer(sock, arena), KEY)
        assert mapped.arena_id == arena.arena_id and mapped.size == arena.size
        assert bytes(mapped.view(4096, 4)) == b"hsx!"
        arena.view[4096:4100] = b"new!"  # one memory: the client sees the server's writes
        assert bytes(mapped.view(4096, 4)) == b"new!"
        with pytest.raises(TypeError):  # read-only
            mapped.view(0, 4)[0:1] = b"x"
        with pytest.raises(ValueError, match="outside"):
            mapped.view(arena.size - 2, 4)
        mapped.close()
        with pytest.raises(shm.ShmUnavailable, match="refused: not allowed"):
            shm.attach(_offer(sock, arena), "wrong-key")
        with pytest.raises(shm.ShmUnavailable, match="refused"):
            shm.attach(_offer(sock, arena), None)
    finally:
        sock.close()


def test_socket_without_keys_takes_same_user_and_refusals_are_reasons(arena):
    sock = ArenaSocket(arena.ro_fd, arena.arena_id, arena.size, []).start()
    try:
        shm.attach(_offer(sock, arena), None).close()  # same uid as the server
        with pytest.raises(shm.ShmUnavailable, match="another host"):
            shm.attach({**_offer(sock, arena), "boot_id": "not-this-host"}, None)
        with pytest.raises(shm.ShmUnavailable, match="arena changed"):
            shm.attach({**_offer(sock, arena), "arena_id": "0" * 32}, None)
        with pytest.raises(shm.ShmUnavailable, match="does not offer"):
            shm.attach(None, None)
    finally:
        sock.close()
    with pytest.raises(shm.ShmUnavailable, match="cannot reach"):  # the server is gone
        shm.attach(_offer(sock, arena), None)


def test_decode_takes_the_states_from_the_lease():
    states = np.arange(2 * 4 * 8, dtype=np.float32).tobytes()
    lease = {"id": "x", "arena_id": "y", "offset": 0, "nbytes": len(states), "dtype": "F32", "shape": [2, 4, 8]}
    body = wire.encode_header([wire.TensorSpec("token_ids", "I64", (2,))], {"lease": json.dumps(lease)})
    body += np.array([5, 6], dtype=np.int64).tobytes()
    d = wire.decode(body, memoryview(states))
    assert d.hidden_states.shape == (2, 4, 8) and float(d.hidden_states[1, 3, 7]) == 63.0
    assert d.token_ids.tolist() == [5, 6] and d.loss_mask is None
    with pytest.raises(wire.WireFormatError, match="bytes for shape"):
        wire.decode(body, memoryview(states)[:-4])
    with pytest.raises(wire.WireFormatError, match="hidden_states"):
        wire.decode(body)  # without the states it is not a whole response


# ----------------------------------------------------------------- against tiny_server

def _prompts(n: int, seed: int, lo: int = 5, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(6, 1000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


async def test_leased_states_equal_the_http_body(tiny_server):
    info = httpx.get(tiny_server.url + "/info").json()
    assert info["shm_lease"]["socket"].startswith("@hsx-lease-") and info["shm_lease"]["boot_id"] == boot_id()
    async with HsxClient(tiny_server.url) as client:
        for ids in _prompts(6, seed=1):
            body = await client.hidden_states_response({"input_ids": ids})  # lease_ok defaults to False
            assert body.lease is None
            leased = await client.hidden_states_response({"input_ids": ids}, lease_ok=True)
            assert leased.lease is not None and len(leased.body) < 1024 + 9 * len(ids)
            a, b = body.decode(), leased.decode()
            assert b.token_ids.tolist() == ids and b.metadata["layer_ids"] == a.metadata["layer_ids"]
            # Sequential single requests: the same computation, so the same bytes.
            assert bytes(leased.lease.states) == a.hidden_states.reshape(-1).view(torch.uint8).numpy().tobytes()
            await client.release_lease(leased.lease)
            with pytest.raises(LeaseExpiredError, match="expired"):
                await client.release_lease(leased.lease)  # once only
        assert client.stats()[tiny_server.url]["transfer"] == "shm-lease"
    async with HsxClient(tiny_server.url, transfer="http") as client:
        r = await client.hidden_states_response({"input_ids": [1, 7, 8]}, lease_ok=True)
        assert r.lease is None and r.decode().hidden_states.shape[0] == 3
    gone = httpx.delete(tiny_server.url + "/leases/" + "ab" * 16)
    assert gone.status_code == 410 and gone.json()["error"]["type"] == "lease_gone"
    text = httpx.get(tiny_server.url + "/metrics").text
    assert 'hsx_leases_total{outcome="released"}' in text and "hsx_leases_live 0.0" in text


# ------------------------------------------------------------- a server of its own

@pytest.fixture(scope="module")
def leasing(tiny_model, log_dir):
    """API key (so the socket wants it too) and a short lease timeout."""
    need_vllm()
    server = ServerProcess(
        str(tiny_model), "--dtype", "float32", "--max-model-len", "1024", "--layers", "1,2,4,6", "--api-key", KEY,
        "--lease-timeout", "1.5", "--arena-bytes", str(16 << 20), "--shutdown-timeout", "30",
        log_dir=log_dir, name="leasing",
    )
    yield server.wait_ready()
    server.stop()


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise KeyError(name)


async def test_expired_lease_answers_410_and_its_range_comes_back(leasing):
    offer = httpx.get(leasing.url + "/info", headers=AUTH).json()["shm_lease"]
    with pytest.raises(shm.ShmUnavailable, match="refused"):
        shm.attach(offer, "not-the-key")
    async with HsxClient(leasing.url, api_key=KEY) as client:
        r = await client.hidden_states_response({"input_ids": [1, 9, 10, 11]}, lease_ok=True)
        assert r.lease is not None
        assert _metric(leasing, "hsx_arena_used_bytes") > 0 and _metric(leasing, "hsx_leases_live") == 1
        await asyncio.sleep(2.5)
        with pytest.raises(LeaseExpiredError) as err:
            await client.release_lease(r.lease)
        assert err.value.status == 410
    assert _metric(leasing, "hsx_arena_used_bytes") == 0
    assert _metric(leasing, "hsx_leases_live") == 0
    text = httpx.get(leasing.url + "/metrics").text
    assert 'hsx_leases_total{outcome="expired"} 1.0' in text
    assert httpx.delete(leasing.url + "/leases/x").status_code == 401  # releases need the key too


def _extract_with(server, fmt, prompts: list[list[int]], tmp_path: Path):
    """`hsx extract`'s run loop, in input order into tmp_path/corpus, with `fmt` as the writer."""
    from hsx_client import extract as hx

    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    hooks = hx.default_hooks()
    hooks.get_format = lambda name: fmt
    cfg = hx.ExtractConfig(servers=[server.url], output=tmp_path / "corpus", inputs=[str(inputs)],
                           format="speculators", api_key=KEY, concurrency_per_server=2, quiet=True, shuffle=False)
    return hx.run_extract(cfg, hooks)


def test_a_sample_whose_lease_expired_is_redone(leasing, tmp_path, caplog):
    """The first store outlives the lease (slow disk): the release answers 410, the
    client asks again, and the corpus ends complete and correct."""
    from hsx_client import extract as hx
    from hsx_client import formats

    class SlowFirst(formats.SpeculatorsFormat):
        slept = 0

        def encode_sample(self, index, decoded, ctx):
            if not SlowFirst.slept:
                SlowFirst.slept = 1
                time.sleep(2.5)
            return super().encode_sample(index, decoded, ctx)

    prompts = _prompts(6, seed=3, lo=5, hi=120)
    out = tmp_path / "corpus"
    with caplog.at_level("WARNING", logger="hsx.extract"):
        result = _extract_with(leasing, SlowFirst(), prompts, tmp_path)
    assert result.exit_code == 0, result.summary
    assert any("lease expired" in r.getMessage() for r in caplog.records)
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(e["index"] for e in lines) == list(range(6))  # each once
    report = hx.verify_corpus(out)
    assert report["ok"] and report["done"] == 6, report
    from safetensors import safe_open

    for i, p in enumerate(prompts):  # shuffle off: row i is prompt i
        with safe_open(str(out / "hidden_states" / f"hs_{i}.safetensors"), framework="pt") as f:
            assert f.get_tensor("token_ids").tolist() == p


def test_a_store_that_always_outlasts_its_lease_fails_that_sample_with_the_fix(leasing, tmp_path):
    from hsx_client import formats

    class AlwaysSlowOnZero(formats.SpeculatorsFormat):
        def encode_sample(self, index, decoded, ctx):
            if index == 0:
                time.sleep(2.0)  # > --lease-timeout 1.5
            return super().encode_sample(index, decoded, ctx)

    out = tmp_path / "corpus"
    result = _extract_with(leasing, AlwaysSlowOnZero(), _prompts(3, seed=4, lo=5, hi=60), tmp_path)
    assert result.summary["done"] == 2 and result.summary["failed"] == 1, result.summary
    failed = [json.loads(x) for x in (out / "failed.jsonl").read_text().splitlines()]
    assert [(f["index"], f["kind"]) for f in failed] == [(0, "lease_expired")]
    assert "3 times" in failed[0]["message"] and "--lease-timeout" in failed[0]["message"]


async def test_sigterm_waits_for_a_held_lease(leasing):
    """Last in this module: it stops the server."""
    async with HsxClient(leasing.url, api_key=KEY) as client:
        r = await client.hidden_states_response({"input_ids": [1, 12, 13]}, lease_ok=True)
        assert r.lease is not None
        leasing.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(leasing.url + "/ready").json()["status"] != "draining":
            assert time.monotonic() < deadline, "SIGTERM did not start the drain in 10 s"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert leasing.proc.poll() is None  # still there for the lease holder
        await client.release_lease(r.lease)
    assert leasing.proc.wait(30) == 0
