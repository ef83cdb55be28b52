"""Issue 26 item 5: each rule of the HTTP side has one owner, tested here without an engine:
the Bearer token, the lease policy, and the race between a request's work and its client
leaving (content negotiation: tests/service/body/test_negotiate.py)."""

from __future__ import annotations

import asyncio

import pytest

from hsx_service.engine.lease import NO_LEASE, LeasePolicy, LeaseTerms
from hsx_service.http.auth import bearer_token
from hsx_service.http.disconnect import race_client


@pytest.mark.parametrize("header, want", [
    ("Bearer k1", "k1"), ("bearer  k1 ", "k1"), ("BEARER k1", "k1"), ("Basic k1", None), ("", None), (None, None),
    ("Bearer", ""),
])
def test_bearer_token(header, want):
    assert bearer_token(header) == want


def test_lease_policy_one_owner():
    keys = LeasePolicy(True, ["a", "b"], ["b"], "worker")
    live = {"s1"}
    assert keys.terms("b", True, "s1", object(), live) == LeaseTerms(True, "s1", False)
    assert keys.terms("a", True, "s1", object(), live) is NO_LEASE  # not a lease key
    assert keys.terms("b", False, "s1", object(), live) is NO_LEASE  # did not ask
    assert keys.terms("b", True, "s2", object(), live) is NO_LEASE  # no live session
    assert keys.terms("b", True, "s1", None, live) is NO_LEASE  # no lease table
    assert keys.terms("worker", True, "s1", object(), live) == LeaseTerms(True, "s1", True)
    off = LeasePolicy(False, [], [], "worker")  # --shm-lease false: only the HTTP workers
    assert not off.may_lease(None) and off.may_lease("worker") and not off.from_http_worker("other")
    assert LeasePolicy(True, [], [], None).may_lease(None)  # no keys at all


def _receive(disconnect: asyncio.Event):
    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}
    return receive


async def test_race_client_work_first_keeps_watching_and_stops_are_cancelled():
    left = asyncio.Event()
    stop = asyncio.Event()
    work = asyncio.ensure_future(asyncio.sleep(0, "done"))
    gone = await race_client(work, _receive(left), stop.wait())
    assert work.result() == "done" and not gone.done()  # still watching the client
    left.set()
    await asyncio.wait_for(gone, 1)


async def test_race_client_client_first_leaves_the_work_to_the_caller():
    left = asyncio.Event()
    work = asyncio.ensure_future(asyncio.sleep(30))
    left.set()
    gone = await race_client(work, _receive(left))
    assert gone.done() and not work.done()
    work.cancel()


async def test_race_client_cancelled_cancels_the_work():
    work = asyncio.ensure_future(asyncio.sleep(30))
    waiter = asyncio.ensure_future(race_client(work, _receive(asyncio.Event())))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0)
    assert work.cancelled()


@pytest.mark.slow  # imports vLLM
def test_engine_errors_have_one_answer_for_prefill_and_generation():
    """Both engine paths answer through engine.prefill.engine_error: vLLM 0.32's
    VLLMValidationError (not a ValueError) is a 400 like a ValueError, never a 500."""
    import asyncio

    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    from hsx_service.engine.prefill import engine_error
    from hsx_service.core.errors import BadInput, EngineFailure, EngineTimeout

    assert isinstance(engine_error(VLLMValidationError("stop cannot contain an empty string."), 30), BadInput)
    assert isinstance(engine_error(ValueError("prompt too long"), 30), BadInput)
    assert isinstance(engine_error(asyncio.TimeoutError(), 30), EngineTimeout)
    assert isinstance(engine_error(EngineDeadError(), 30), EngineFailure)
    assert engine_error(KeyError("x"), 30) is None
