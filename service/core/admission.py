"""The one admission gate of POST /hidden_states (and of POST /tokenize, at the door only).

A request passes it twice. At the door (the guard middleware, before its body is read):
at most `--max-inflight` requests are past it at once, so a flood of large bodies cannot
grow memory, and a draining server refuses at once. Then, once its prompt is tokenized:
its tokens must fit `--max-queued-tokens` beside the others', and a draining server or a
dead engine refuses it. Its place is held until its response has ended (the middleware
releases the ticket). Every refusal is a ServiceError (core/errors.py); it is counted by
reason in `hsx_rejected_total` where it is rendered (http/errors.render).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hsx_service.core.errors import Draining, NotReady, Overloaded
from hsx_service.core.metrics import Metrics

DRAIN_RETRY_AFTER = 5.0


class Ticket:
    """One request's place in the gate; `release()` gives it back, once."""

    __slots__ = ("_gate", "tokens", "_open", "entered", "client")

    def __init__(self, gate: "AdmissionGate", client: str = "") -> None:
        self._gate = gate
        self.client = client  # who sends it (guard.py): its fair share of the tokenizer processes
        self.tokens = 0
        self._open = True
        self.entered = time.perf_counter()  # past the door, body read: the "wait" phase starts

    def admit(self, num_tokens: int) -> None:
        """Take `num_tokens` of the token budget; raises Draining, NotReady or Overloaded."""
        self._gate._admit(self, num_tokens)

    def release(self) -> None:
        if self._open:
            self._open = False
            self._gate.in_flight -= 1
            self._gate.queued_tokens -= self.tokens
            self.tokens = 0


class AdmissionGate:
    def __init__(self, max_inflight: int, max_queued_tokens: int, metrics: Metrics) -> None:
        self.max_inflight = max_inflight
        self.max_queued_tokens = max_queued_tokens
        self.in_flight = 0  # requests past the door whose response has not ended
        self.queued_tokens = 0  # prompt tokens of admitted requests
        self.draining = False
        self.engine_dead: Callable[[], bool] = lambda: False  # set once the engine exists
        metrics.inflight.set_function(lambda: self.in_flight)
        metrics.queued_tokens.set_function(lambda: self.queued_tokens)

    def enter(self, client: str = "") -> Ticket:
        """At the door, before the body is read (`client`: see Ticket)."""
        if self.draining:
            raise self._draining()
        if self.in_flight >= self.max_inflight:
            raise Overloaded(
                f"{self.in_flight} requests in progress (limit {self.max_inflight}); retry shortly", reason="inflight"
            )
        self.in_flight += 1
        return Ticket(self, client)

    def _admit(self, ticket: Ticket, num_tokens: int) -> None:
        if self.draining:
            raise self._draining()
        if self.engine_dead():
            raise NotReady("the engine is not running", reason="engine_dead")
        if self.queued_tokens and self.queued_tokens + num_tokens > self.max_queued_tokens:
            raise Overloaded(
                f"{self.queued_tokens} prompt tokens queued (limit {self.max_queued_tokens}); retry shortly",
                reason="tokens",
            )
        ticket.tokens += num_tokens
        self.queued_tokens += num_tokens

    @staticmethod
    def _draining() -> Draining:
        return Draining("the server is shutting down; send this request to another server",
                        retry_after=DRAIN_RETRY_AFTER)
