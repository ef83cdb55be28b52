"""The messages between `hsx extract --workers`' parent and its worker processes (one pipe
each way per worker, pickled by multiprocessing).

Dataclasses, not pydantic models: both ends are this code, so there is nothing to validate,
and a stored sample sends two of them; a frozen dataclass costs nothing per message beyond
the pickle a tuple cost, while each side matches on the class instead of on position 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# ------------------------------------------------------------- parent -> worker
@dataclass(frozen=True)
class Samples:
    """Indices to extract, with their samples (the worker has no input of its own)."""

    items: list[tuple[int, Any]]


@dataclass(frozen=True)
class End:
    """No more samples: finish those held, then exit."""


@dataclass(frozen=True)
class Stop:
    """The run stops (Ctrl-C, an error): cancel what is in flight, then exit."""

    reason: str | None


# ------------------------------------------------------------- worker -> parent
@dataclass(frozen=True)
class Ready:
    """Imports done and client up: the parent may start its clock and send samples."""


@dataclass(frozen=True)
class Stored:
    """A manifest entry: the sample's files are on disk; the parent writes the line."""

    entry: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """A failed.jsonl entry (a failure, or a sample dropped by policy)."""

    entry: dict[str, Any]


@dataclass(frozen=True)
class Progressed:
    """A stored sample's numbers for the parent's progress bar."""

    tokens: int
    wire_bytes: int
    written_bytes: int


@dataclass(frozen=True)
class Note:
    """A line for the parent to print above its progress bar."""

    text: str


@dataclass(frozen=True)
class Exited:
    """The worker's last message: its fatal error (None: a clean end) and its books (its
    client's per-server counters, store and life seconds) for the run's totals."""

    error: str | None
    books: dict[str, Any] = field(default_factory=dict)
