"""Chunked states: a sample larger than its stream window goes through the arena in token ranges.

The API process reserves a window of `len(slots)` slots of `chunk_tokens` tokens each (not the
whole sample) and passes the plan with the request (`ChunkPlan`, in `kv_transfer_params`). The
request's states stay in its KV blocks on the device until the connector reports it finished,
so the worker copies them out slot by slot:

- it copies chunk i into a free slot and tells the API process (notice `{"key", "chunk": i,
  "slot": s, "ok": true}` on the completion channel, once the copy has landed);
- the API process sends the chunk (an HTTP body piece, or a lease record) and hands the slot
  back: a *credit* `{"key", "slot": s}` on the credit channel; the worker reuses the slot;
- after the last chunk, or on a cancel `{"key", "cancel": true}` (the client left), the worker
  waits for the copies it issued and sends `{"key", "end": true, "ok": ...}`; only then does
  the API process free the window, and `get_finished` frees the request's blocks.

Why a ZMQ PUB/SUB socket for credits (API -> worker): the worker must never wait for a credit
inside vLLM's engine loop, so it drains its SUB socket without blocking at each step (bind of
the step's metadata, `get_finished`): while a request's blocks are held, vLLM keeps stepping
(delayed frees count as work), so credits are picked up within a step. PUB/SUB, not PUSH/PULL:
every engine core's writer (data parallel) sees every credit and keeps those of its own keys;
PUSH would deal them round-robin. A control area in the arena would need polling of shared
memory for the same effect and a lock-free layout; a socket is already how notices travel.
A cancel may arrive before the worker learns of the save (the client left during the
prefill): cancels of unknown keys are remembered (bounded) and applied when the save starts.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

CHUNKS_KEY = "chunks"  # in hsx's kv_transfer_params: the ChunkPlan of a chunked save
MIN_SLOTS = 2  # one slot copied into while the other is sent
MAX_SLOTS = 8
CANCELS_REMEMBERED = 4096


@dataclass(frozen=True)
class ChunkPlan:
    chunk_tokens: int
    slots: tuple[int, ...]  # arena offsets of the window's slots
    token_bytes: int  # bytes of one token's states (L x H x itemsize)

    @property
    def slot_bytes(self) -> int:
        return self.chunk_tokens * self.token_bytes

    def to_params(self) -> dict:
        return {"tokens": self.chunk_tokens, "slots": list(self.slots), "token_bytes": self.token_bytes}

    @classmethod
    def from_params(cls, params: dict) -> "ChunkPlan":
        return cls(int(params["tokens"]), tuple(int(s) for s in params["slots"]), int(params["token_bytes"]))


def num_chunks(num_tokens: int, chunk_tokens: int) -> int:
    return -(-num_tokens // chunk_tokens)


def chunk_range(index: int, num_tokens: int, chunk_tokens: int) -> tuple[int, int]:
    start = index * chunk_tokens
    return start, min(num_tokens, start + chunk_tokens)


def plan_slots(window_bytes: int, token_bytes: int) -> tuple[int, int]:
    """(slots, tokens per slot) for a window of `window_bytes`: at least MIN_SLOTS so copy and
    send overlap, whole tokens per slot."""
    per_slot = window_bytes // MIN_SLOTS
    slots = MIN_SLOTS
    # Large windows: more, smaller slots keep the pipe full without larger pieces in flight.
    while slots < MAX_SLOTS and per_slot // 2 >= 64 << 20:
        slots *= 2
        per_slot //= 2
    tokens = max(1, per_slot // token_bytes)
    return slots, tokens


class ChunkedSave:
    """The worker's state of one chunked save: which chunk is next, which slots are free."""

    def __init__(self, key: str, num_tokens: int, plan: ChunkPlan) -> None:
        self.key = key
        self.num_tokens = num_tokens
        self.plan = plan
        self.free: deque[int] = deque(range(len(plan.slots)))
        self.next = 0
        self.total = num_chunks(num_tokens, plan.chunk_tokens)
        self.cancelled = False
        self.ended = False  # its end notice is queued

    def credit(self, slot: int) -> None:
        if 0 <= slot < len(self.plan.slots) and slot not in self.free:
            self.free.append(slot)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def issued_all(self) -> bool:
        """Nothing more will be copied: every chunk was issued, or it was cancelled."""
        return self.cancelled or self.next >= self.total

    def ready(self) -> Iterator[tuple[int, int, int, int]]:
        """(chunk, slot, first token, end token) for each copy that may start now."""
        while self.free and not self.issued_all:
            slot = self.free.popleft()
            start, stop = chunk_range(self.next, self.num_tokens, self.plan.chunk_tokens)
            yield self.next, slot, start, stop
            self.next += 1


class CreditBook:
    """The worker's chunked saves by key and the credit messages applied to them."""

    def __init__(self) -> None:
        self.saves: dict[str, ChunkedSave] = {}
        self._early_cancels: OrderedDict[str, None] = OrderedDict()

    def add(self, save: ChunkedSave) -> None:
        if self._early_cancels.pop(save.key, 0) is None:
            save.cancel()
        self.saves[save.key] = save

    def apply(self, msg: dict) -> None:
        save = self.saves.get(msg.get("key", ""))
        if msg.get("cancel"):
            if save is not None:
                save.cancel()
            else:
                self._early_cancels[msg["key"]] = None
                while len(self._early_cancels) > CANCELS_REMEMBERED:
                    self._early_cancels.popitem(last=False)
        elif save is not None and "slot" in msg:
            save.credit(int(msg["slot"]))

    def drop(self, key: str) -> None:
        self.saves.pop(key, None)


class CreditInbox:
    """SUB side of the credit channel, drained without blocking (worker)."""

    def __init__(self, address: str) -> None:
        import zmq

        self._zmq = zmq
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(address)

    def drain(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(json.loads(self._sock.recv(self._zmq.NOBLOCK)))
            except self._zmq.Again:
                return out


class CreditSender:
    """PUB side of the credit channel (API process): never blocks the event loop."""

    def __init__(self, address: str) -> None:
        import zmq

        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # credits are few and tiny; none may be dropped
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)

    def credit(self, key: str, slot: int) -> None:
        self._sock.send(json.dumps({"key": key, "slot": slot}).encode())

    def cancel(self, key: str) -> None:
        self._sock.send(json.dumps({"key": key, "cancel": True}).encode())

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
        path = self.address.removeprefix("ipc://")
        import os

        if os.path.exists(path):
            os.unlink(path)
