"""What hsx's KV connector passes between its sides: a save (one finished request's pages
and arena range, scheduler -> worker, inside vLLM's connector metadata each step) and the
completion notices (worker and scheduler -> the API process, over ZMQ)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import zmq

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class PendingSave:
    req_id: str
    key: str
    block_ids: list[int]
    num_tokens: int
    offset: int
    nbytes: int
    layer_positions: list[int]  # positions within the captured layers, ascending
    last_step: int = -1  # the last step the request was scheduled in (-1: unknown)
    chunks: dict | None = None  # a chunked save's ChunkPlan (chunks.py); None: the whole range


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    saves: list[PendingSave] = field(default_factory=list)
    step: int = -1  # the scheduler's count of the step this metadata belongs to
    started: bool = False  # worker side: its copies were issued (each worker has its own copy)


def ready_event(events: dict, last_step: int):
    """The event recorded at the bind of the step after `last_step` (every write of a
    request's states precedes it on the compute stream), or None when none was kept."""
    return events.get(last_step + 1) if last_step >= 0 else None


class Notifier:
    """PUSH side of the completion channel; one per process role, one sending thread."""

    def __init__(self, address: str):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def send(self, key: str, ok: bool, error: str | None = None, **extra: Any) -> None:
        self._sock.send(json.dumps({"key": key, "ok": ok, "error": error, **extra}).encode())
