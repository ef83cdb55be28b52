"""What reading an input row gives: a planned Sample, or a BadRow and its kind."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One planned request: a stable `key`, a `source` for error reports, the JSON `request`."""

    key: str
    source: str
    request: dict


# BadRow kinds, for the summary's counts (the reason says the details).
NO_ASSISTANT = "no_assistant_turn"
QUESTION_ONLY = "question_only"


@dataclass
class BadRow:
    """An input row that could not be used (`source` is file:line), and why."""

    source: str
    reason: str
    kind: str = "malformed"  # malformed | invalid_json | not_utf8 | no_assistant_turn | question_only | unknown_shape


class RowProblem(Exception):
    """A row-level problem: becomes a BadRow."""

    def __init__(self, reason: str, kind: str = "malformed") -> None:
        super().__init__(reason)
        self.kind = kind
