"""The app in process (httpx ASGITransport) over a stand-in engine: the guard, the one
admission gate and its 503 counts, and who frees the arena range. Fast: no vLLM.

The stand-in replaces only the engine (vLLM); the app, the middleware, the service, the
real shared-memory arena and its allocator are the server's own. Against real engines
the same paths run in test_service_hardening.py and test_shm_lease.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from prometheus_client import generate_latest

from hsx import wire
from hsx_tools.server_process import MetricValues
from hsx_service.http.app import create_app
from hsx_service.http.state import AppState
from hsx_service.engine.arena import Allocator, SharedArena
from hsx_service.engine.config import ModelFacts
from hsx_service.core.errors import EngineFailure
from hsx_service.http.guard import PUBLIC_PATHS
from hsx_service.core.metrics import Metrics, sample_loop_lag
from hsx_service.serving import HiddenStatesService
from hsx_service.settings import ServiceSettings

KEY = "app-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
H = 8


class StandInEngine:
    """What HiddenStatesService needs of hsx_service.engine.prefill.PrefillEngine, without vLLM:
    `extract` writes a known pattern into the reserved range. `hold` makes requests
    wait inside the engine; `fail_after_hand_over` imitates a failure while the worker
    may still write (the range is freed only on `notice`)."""

    def __init__(self, arena: SharedArena):
        self.facts = ModelFacts(
            model="stand-in", revision=None, served_model_name="stand-in", architecture="LlamaForCausalLM",
            num_hidden_layers=4, hidden_size=H, vocab_size=100, dtype="float32", max_model_len=256,
            layer_ids=[1, 2, 3, 4], tokenizer="stand-in", tokenizer_revision=None, trust_remote_code=False,
            vllm_version="0.0",
        )
        self.arena = arena
        self.allocator = Allocator(arena.size)
        self.window_bytes = arena.size  # no sample is chunked here (tests/service/test_chunked_states.py)
        self.engine_running = 0
        self.dead = False
        self.notices = None
        self.hold: asyncio.Event | None = None
        self.fail_after_hand_over = False
        self.notice = asyncio.Event()
        self.entered = asyncio.Event()

    def reserve(self, num_tokens, num_layers):
        from hsx_service.engine.prefill import PrefillEngine

        return PrefillEngine.reserve(self, num_tokens, num_layers)  # the real one: errors included

    def bytes_for(self, num_tokens, num_layers):
        return num_tokens * num_layers * H * 4

    @property
    def settings(self):
        return ServiceSettings(arena_bytes=self.arena.size)

    async def extract(self, token_ids, layer_positions, reservation, request_id):
        self.engine_running += 1
        self.entered.set()
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.fail_after_hand_over:
                held = reservation.hand_over()

                async def later():
                    await self.notice.wait()
                    held.release()

                asyncio.get_running_loop().create_task(later())
                raise EngineFailure("the engine failed while serving this request")
            n = len(token_ids)
            states = np.arange(n * len(layer_positions) * H, dtype=np.float32)
            self.arena.slice(reservation.extent)[:] = states.tobytes()
            return {"engine": 0.0, "copy": 0.0}
        finally:
            self.engine_running -= 1


class StandInTokenizer:
    template_sha256 = None


@pytest.fixture
def arena(tmp_path):
    a = SharedArena.create(str(tmp_path), 1 << 20)
    yield a
    a.close()


class StandInSessions:
    """The arena socket's live lease sessions (lease.ArenaSocket.sessions), without the socket."""

    def __init__(self, *sessions: str):
        self.sessions = set(sessions)


SESSION = "session-a"
LEASE = {"Accept": wire.LEASE_MEDIA_TYPE, "X-Hsx-Lease-Session": SESSION}


def make_app(arena, *, serving=True, **settings):
    settings = ServiceSettings(**{"arena_bytes": arena.size, "shm_lease": True, **settings})
    engine = StandInEngine(arena)
    st = AppState(settings=settings, prefill=engine)
    if serving:
        st.service = HiddenStatesService(settings, engine, StandInTokenizer(), st.metrics, st.gate)
        st.arena_socket = StandInSessions(SESSION, "session-b")
    return create_app(st), st, engine


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app", timeout=30)


def metrics(st) -> MetricValues:
    return MetricValues(generate_latest(st.metrics.registry).decode())


# ---------------------------------------------------------------------------- the guard

async def test_a_new_route_is_guarded_by_default(arena):
    app, st, _ = make_app(arena, api_key=[KEY])

    @app.get("/added-later")
    async def added_later():
        return {"ok": True}

    async with client(app) as c:
        r = await c.get("/added-later")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "unauthorized" and r.json()["error"]["request_id"]
        assert (await c.get("/added-later", headers=AUTH)).status_code == 200
        assert (await c.get("/no-such-route")).status_code == 401  # unknown paths too
        for path in ("/info", "/final_norm", "/leases/x"):
            assert (await c.get(path)).status_code == 401, path
        for path in PUBLIC_PATHS:
            assert (await c.get(path)).status_code != 401, path
        assert (await c.get("/openapi.json")).json()["info"]["title"] == "hsx"


async def test_v1_models_lists_the_served_model_as_vllm_does_behind_the_key(arena):
    """Issue 36.11: no /v1/models (404) stopped speculators' regenerate-responses ("No
    models found at endpoint") and the openai client's models.list()."""
    app, st, engine = make_app(arena, api_key=[KEY])
    async with client(app) as c:
        assert (await c.get("/v1/models")).status_code == 401
        r = await c.get("/v1/models", headers=AUTH)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and len(body["data"]) == 1
        card = body["data"][0]
        facts = engine.facts
        assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
            "id": facts.served_model_name, "object": "model", "owned_by": "vllm", "root": facts.model,
            "parent": None, "max_model_len": facts.max_model_len}
        assert abs(card["created"] - time.time()) < 60
        assert [p["object"] for p in card["permission"]] == ["model_permission"]
    app, st, _ = make_app(arena, serving=False)
    async with client(app) as c:
        r = await c.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["type"] == "not_ready"


@pytest.mark.parametrize("route", ["/hidden_states", "/tokenize"])
async def test_refusals_before_the_body_are_the_error_classes(arena, route):
    app, st, _ = make_app(arena, api_key=[KEY], max_body_bytes=2048)
    async with client(app) as c:
        r = await c.post(route, content=b"x", headers={**AUTH, "X-Request-Id": "rid-1"})
        assert r.status_code == 415 and r.json()["error"] == {
            "type": "unsupported_media_type", "request_id": "rid-1",
            "message": "send the request as Content-Type: application/json (got 'none')"}
        assert r.headers["x-request-id"] == "rid-1"
        r = await c.post(route, content=b"[" + b"1," * 2000 + b"1]",
                         headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "too_large" and "2048" in r.text
        r = await c.post(route, json={"input_ids": [1, 2]}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and "nope" not in r.text
    assert st.gate.in_flight == 0


# ---------------------------------------------------------------------------- admission

async def test_every_503_sent_is_counted_by_reason(arena):
    app, st, engine = make_app(arena, max_inflight=2, max_queued_tokens=10)
    sent: dict[str, int] = {}

    def count(r):
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        sent[r.json()["error"]["type"]] = sent.get(r.json()["error"]["type"], 0) + 1

    async with client(app) as c:
        engine.hold = asyncio.Event()
        first = asyncio.ensure_future(c.post("/hidden_states", json={"input_ids": [1] * 8}))
        await asyncio.wait_for(engine.entered.wait(), 10)
        count(await c.post("/hidden_states", json={"input_ids": [1] * 8}))  # 8 + 8 tokens > 10
        second = asyncio.ensure_future(c.post("/hidden_states", json={"input_ids": [1, 2]}))
        while engine.engine_running < 2:
            await asyncio.sleep(0.01)
        count(await c.post("/hidden_states", json={"input_ids": [3]}))  # two in progress: the door
        engine.hold.set()
        assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
        filler = engine.allocator.allocate(arena.size - 4096)  # the arena nearly full
        count(await c.post("/hidden_states", json={"input_ids": [1] * 200}))  # 25,600 bytes: memory
        engine.allocator.free(filler)
        st.gate.draining = True
        count(await c.post("/hidden_states", json={"input_ids": [1]}))
        st.gate.draining = False
        engine.dead = True
        count(await c.post("/hidden_states", json={"input_ids": [1]}))
    m = metrics(st)
    rejected = {r: m.get("hsx_rejected_total", 0, reason=r) for r in ("inflight", "tokens", "memory", "draining",
                                                                        "engine_dead")}
    assert rejected == {"inflight": 1, "tokens": 1, "memory": 1, "draining": 1, "engine_dead": 1}
    assert sum(rejected.values()) == sum(sent.values()) == 5
    assert m.get("hsx_inflight_requests") == 0 and m.get("hsx_queued_tokens") == 0
    assert m.get("hsx_arena_used_bytes") == 0


async def test_while_loading_every_route_but_the_probes_answers_503_counted(arena):
    app, st, _ = make_app(arena, serving=False)
    async with client(app) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/ready")).json()["status"] == "loading"
        for r in (await c.get("/info"), await c.post("/hidden_states", json={"input_ids": [1]})):
            assert r.status_code == 503 and r.json()["error"]["type"] == "not_ready", r.text
    assert metrics(st).get("hsx_rejected_total", reason="loading") == 2
    assert st.gate.in_flight == 0


# ---------------------------------------------------------------------------- arena ranges

async def test_the_range_is_freed_by_whoever_owns_it(arena):
    app, st, engine = make_app(arena)
    used = lambda: st.prefill.allocator.used  # noqa: E731
    async with client(app) as c:
        r = await c.post("/hidden_states", json={"input_ids": [5, 6, 7]})
        d = wire.decode(r.content)
        assert d.token_ids.tolist() == [5, 6, 7] and float(d.hidden_states[2, 3, 7]) == 95.0
        assert used() == 0
        # a lease owns it until the client's release
        r = await c.post("/hidden_states", json={"input_ids": [5, 6]}, headers=LEASE)
        lease = wire.lease_of(r.content)
        assert r.headers["content-type"] == wire.LEASE_MEDIA_TYPE and used() == 4096
        assert bytes(arena.view[lease["offset"]:lease["offset"] + 16]) == np.arange(4, dtype=np.float32).tobytes()
        assert (await c.delete(f"/leases/{lease['id']}")).status_code == 204 and used() == 0
        assert (await c.delete(f"/leases/{lease['id']}")).status_code == 410  # once only
        # after an engine failure the engine owns it until its notice
        engine.fail_after_hand_over = True
        r = await c.post("/hidden_states", json={"input_ids": [1, 2]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_error"
        assert used() == 4096  # the request's own cleanup did not free it
        engine.notice.set()
        await asyncio.sleep(0)
        assert used() == 0
    m = metrics(st)
    assert m.get("hsx_leases_total", outcome="released") == 1 and m.get("hsx_requests_total", status="error") == 1


# ---------------------------------------------------------------------------- where the time goes

async def test_each_request_records_its_wait_before_the_handler(arena):
    app, st, _ = make_app(arena)
    async with client(app) as c:
        for ids in ([5, 6, 7], [1, 2]):
            assert (await c.post("/hidden_states", json={"input_ids": ids})).status_code == 200
    m = metrics(st)
    assert m.get("hsx_phase_seconds_count", phase="wait") == 2 and m.get("hsx_phase_seconds_sum", phase="wait") >= 0
    assert m.get("hsx_phase_seconds_count", phase="send") == 2


async def test_event_loop_lag_shows_a_blocked_loop():
    m = Metrics()
    probe = asyncio.create_task(sample_loop_lag(m, interval=0.02))
    await asyncio.sleep(0.05)  # a few on-time samples
    time.sleep(0.3)  # the loop is blocked: the next timer fires ~0.3 s late
    await asyncio.sleep(0.05)
    probe.cancel()
    values = MetricValues(generate_latest(m.registry).decode())
    assert values.get("hsx_event_loop_lag_seconds_count") >= 3
    assert values.get("hsx_event_loop_lag_seconds_sum") >= 0.25


async def test_expired_and_shutdown_leases_free_their_ranges(arena):
    app, st, _ = make_app(arena, lease_timeout=0.2)
    async with client(app) as c:
        for _ in range(2):
            r = await c.post("/hidden_states", json={"input_ids": [1]}, headers=LEASE)
            assert r.status_code == 200
        assert st.prefill.allocator.used == 2 * 4096
        st.service.leases.end_all()  # what the lifespan does at shutdown
        assert st.prefill.allocator.used == 0
        r = await c.post("/hidden_states", json={"input_ids": [1]}, headers=LEASE)
        lease_id = json.loads(wire.parse_header(r.content)[0]["__metadata__"]["lease"])["id"]
        await asyncio.sleep(0.4)
        assert st.prefill.allocator.used == 0
        assert (await c.delete(f"/leases/{lease_id}")).status_code == 410
    m = metrics(st)
    assert m.get("hsx_leases_total", outcome="shutdown") == 2 and m.get("hsx_leases_total", outcome="expired") == 1


async def test_a_lease_needs_a_live_session_and_a_session_s_leases_are_capped(arena):
    """Issue 25: a lease asked without a session was granted, and nothing released it
    before --lease-timeout: a flood of them held the whole arena and every request was
    refused 503 'memory full'. Now: without a live session, an HTTP body; within one, at
    most --lease-max-per-session leases, and client leases hold at most half the arena."""
    app, st, _ = make_app(arena, lease_max_per_session=3)
    used = lambda: st.prefill.allocator.used  # noqa: E731
    ctype = lambda r: r.headers["content-type"]  # noqa: E731
    async with client(app) as c:
        for session in (None, "made-up"):
            headers = {"Accept": f"{wire.LEASE_MEDIA_TYPE}, {wire.MEDIA_TYPE};q=0.5"}
            if session:
                headers["X-Hsx-Lease-Session"] = session
            for _ in range(40):  # more than the arena holds (256 ranges of 4096 bytes: below)
                r = await c.post("/hidden_states", json={"input_ids": [5, 6]}, headers=headers)
                assert r.status_code == 200 and ctype(r) == wire.MEDIA_TYPE, r.text
            assert used() == 0 and len(st.service.leases) == 0
        held = [await c.post("/hidden_states", json={"input_ids": [5, 6]}, headers=LEASE) for _ in range(5)]
        assert [ctype(r) for r in held] == [wire.LEASE_MEDIA_TYPE] * 3 + [wire.MEDIA_TYPE] * 2
        assert used() == 3 * 4096
        other = await c.post("/hidden_states", json={"input_ids": [5]}, headers={**LEASE, "X-Hsx-Lease-Session": "session-b"})
        assert ctype(other) == wire.LEASE_MEDIA_TYPE  # the cap is per session
        st.service.leases.end_session(SESSION)  # its socket closed
        assert used() == 4096
        # Client leases together: at most half the arena (512 KiB of 1 MiB; 4 KiB held by session-b).
        big = {"input_ids": [7] * 200}  # 200 tokens x 4 layers x 8 x 4 bytes: 28 KiB reserved
        st.service.leases.per_session = 1000
        kinds = [ctype(await c.post("/hidden_states", json=big, headers=LEASE)) for _ in range(21)]
        fit = (arena.size // 2 - 4096) // (28 << 10)
        assert kinds == [wire.LEASE_MEDIA_TYPE] * fit + [wire.MEDIA_TYPE] * (21 - fit), kinds
        assert used() <= arena.size // 2
    m = metrics(st)
    assert m.get("hsx_leases_total", outcome="refused_session") == 2
    assert m.get("hsx_leases_total", outcome="refused_arena") == 21 - fit
