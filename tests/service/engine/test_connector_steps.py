"""Which step a finished request's copy waits for (service/engine/connector.py): the scheduler
side notes the last step each request was scheduled in, a save carries it, and the
worker picks the event recorded at the next step's bind. Fast tier: the connector's
scheduler-side methods on fake scheduler outputs and requests, no engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from hsx.protocol import KV_PARAMS_KEY  # noqa: E402
from hsx_service.engine import connector as conn  # noqa: E402


class _Quiet:
    def send(self, *args, **kwargs):
        self.sent = args


def scheduler_side() -> conn.HsxConnector:
    c = object.__new__(conn.HsxConnector)  # the scheduler-side state only (no vLLM config)
    c._pending, c._step, c._last_step, c._notifier = {}, 0, {}, _Quiet()
    return c


def step(c: conn.HsxConnector, *req_ids: str) -> conn.HsxConnectorMetadata:
    return c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={r: 1 for r in req_ids}))


def finished(c: conn.HsxConnector, req_id: str, hsx: bool = True, tokens: int = 4):
    req = SimpleNamespace(request_id=req_id, status=RequestStatus.FINISHED_LENGTH_CAPPED,
                          prompt_token_ids=list(range(tokens)), num_computed_tokens=tokens,
                          kv_transfer_params={KV_PARAMS_KEY: {"key": req_id, "offset": 0, "nbytes": 8,
                                                                "layer_positions": [0]}} if hsx else None)
    return c.request_finished(req, [1])


def test_async_scheduling_save_waits_for_the_step_after_its_last_forward():
    c = scheduler_side()
    assert step(c, "a", "b").step == 1
    step(c, "b")  # step 2 is built before step 1's output is processed (async scheduling)
    assert finished(c, "a") == (True, None)  # a's prefill ended in step 1
    meta = step(c)  # step 3 carries the save
    (save,) = meta.saves
    assert (meta.step, save.last_step) == (3, 1)
    events = {1: "e1", 2: "e2", 3: "e3"}
    assert conn.ready_event(events, save.last_step) == "e2"  # not e3: step 2's forward is not waited for


def test_sync_scheduling_save_waits_for_the_current_bind():
    c = scheduler_side()
    step(c, "a")
    finished(c, "a")  # step 1's output processed before step 2 is built
    meta = step(c)
    assert conn.ready_event({1: "e1", 2: "e2"}, meta.saves[0].last_step) == "e2"


def test_unknown_step_falls_back_and_finished_requests_are_forgotten():
    c = scheduler_side()
    step(c, "a", "plain")
    finished(c, "plain", hsx=False)  # not an hsx request: no save, but forgotten all the same
    finished(c, "never-scheduled")
    assert c._last_step == {"a": 1}
    (save,) = step(c).saves
    assert save.last_step == -1 and conn.ready_event({1: "e1"}, save.last_step) is None
    assert conn.ready_event({5: "e5"}, 1) is None  # its bind's event no longer kept: a fresh one


def test_aborted_request_is_released_not_saved():
    c = scheduler_side()
    step(c, "a")
    req = SimpleNamespace(request_id="a", status=RequestStatus.FINISHED_ABORTED, prompt_token_ids=[1, 2],
                          num_computed_tokens=2, kv_transfer_params={KV_PARAMS_KEY: {"key": "a"}})
    assert c.request_finished(req, [1]) == (False, None)
    assert c._notifier.sent == ("a", False, "aborted") and not c._last_step and not step(c).saves
