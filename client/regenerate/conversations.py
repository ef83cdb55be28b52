"""Input rows -> conversations to regenerate (the readers of hsx_client.corpus.inputs, one
conversation per row, keyed `{name}:{n}` as extract keys its rows). A row's images are
`image_url` parts as extract reads them (hsx_client.corpus.images: a missing file is a bad
row); every turn is asked with the images of the messages before it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hsx_client.corpus import images
from hsx_client.corpus.inputs import CHAT_READERS, chat_messages, row_kind
from hsx_client.corpus.sources import open_source
from hsx_client.corpus.rows import BadRow, RowProblem


@dataclass(frozen=True)
class Conversation:
    key: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[dict] | None = None

    @property
    def has_images(self) -> bool:
        return images.has_images({"messages": self.messages})


def read_conversations(paths: list[str], bad_rows: list[BadRow]) -> list[Conversation]:
    """Every usable row of `paths`, in input order. A row with no user turn, or a
    pre-tokenized one (no turns to regenerate), goes to `bad_rows`."""
    base = [p[3:] if p.startswith("hf:") else os.path.basename(os.path.normpath(p)) for p in paths]
    clash = {b for b in base if base.count(b) > 1}
    out: list[Conversation] = []
    for spec, b in zip(paths, base):
        name, rows = open_source(spec)
        base_dir = images.source_dir(spec)
        if b in clash:
            name = spec
        for n, row, err in rows:
            source = f"{spec}:{n}"
            if err is not None:
                bad_rows.append(BadRow(source, str(err), getattr(err, "kind", "invalid_json")))
                continue
            try:
                msgs, tools = _messages(row, base_dir)
                if not any(m["role"] == "user" for m in msgs):
                    raise RowProblem("conversation has no user turn to answer", "no_user_turn")
                out.append(Conversation(f"{name}:{n}", source, msgs, tools))
            except RowProblem as exc:
                bad_rows.append(BadRow(source, str(exc), exc.kind))
    return out


def _messages(row: Any, base_dir: Any) -> tuple[list[dict], list | None]:
    kind = row_kind(row)
    if kind in CHAT_READERS:
        return chat_messages(kind, row, base_dir)
    if kind in ("prompt", "text"):
        text = row[kind]
        if not isinstance(text, str) or not text.strip():
            raise RowProblem(f"'{kind}' must be a non-empty string")
        return [{"role": "user", "content": text}], None
    if kind == "mtbench_question":
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise RowProblem("MT-Bench 'turns' must be a non-empty list of strings")
        return [{"role": "user", "content": t} for t in turns], None
    if kind == "pretokenized":
        raise RowProblem("pre-tokenized rows have no turns to regenerate", "pretokenized")
    raise RowProblem(f"{kind} rows cannot be regenerated (give the question file instead)", "unknown_shape")
