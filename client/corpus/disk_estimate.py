"""The disk a run will need, estimated before it starts.

Token estimate for the disk check: `input_ids` length, else characters / 3 of the prompt,
messages and tools (+8 per message), capped at `--max-length` and the server's
max_model_len, then scaled by the served tokenizer's real counts: up to COUNT_SAMPLE
planned samples are tokenized by the server (`POST /tokenize`, no prefill); the ratio of
their real to estimated tokens (before truncation) scales each estimate before the cap,
and the share of tokens in rows that will be dropped is taken off (characters / 3 alone
was 0.5x to 1.4x off on the shared fixtures with a 512-token vocab).

`check_disk_space` then refuses a run its filesystem cannot hold (`--force-disk` runs it anyway).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.sizes import fmt_bytes
from hsx_client.corpus.store import StoreError


def estimate_tokens(request: dict[str, Any], max_length: int | None, max_model_len: int | None) -> int:
    if "input_ids" in request:
        n = len(request["input_ids"])
    else:
        chars = 0
        if isinstance(request.get("prompt"), str):
            chars += len(request["prompt"])
        for m in request.get("messages") or []:
            chars += 32  # role + template tokens, ~8 tokens a message
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                chars += len(c)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
            if isinstance(m, dict) and m.get("tool_calls"):
                chars += len(json.dumps(m["tool_calls"]))
        if request.get("tools"):
            chars += len(json.dumps(request["tools"]))
        n = chars // 3 + 1
    for cap in (max_length, max_model_len):
        if cap:
            n = min(n, int(cap))
    return n


COUNT_SAMPLE = 64  # planned samples the server tokenizes for the disk estimate


def disk_needed(requests: Iterable[dict[str, Any]], bytes_per_token: float, max_length: int | None,
                max_model_len: int | None, token_ratio: float = 1.0, kept: float = 1.0,
                bytes_per_request: Callable[[dict[str, Any]], int] | None = None) -> int:
    """Bytes the samples of `requests` will take: estimated tokens (x `token_ratio`, the
    served tokenizer's real / estimated count, then capped; x `kept`, the share not dropped)
    x the format's bytes per token, plus 4 KiB a sample for headers and file-system slack,
    plus what `bytes_per_request` says a sample's files take beyond its tokens (an image
    chat's request file in a token table: its images' base64)."""
    total = 0.0
    extra = 0
    count = 0
    cap = min((int(c) for c in (max_length, max_model_len) if c), default=None)
    for r in requests:
        n = estimate_tokens(r, None, None) * token_ratio
        total += min(n, cap) if cap else n
        extra += bytes_per_request(r) if bytes_per_request is not None else 0
        count += 1
    return int(total * kept * float(bytes_per_token) + extra * kept + 4096 * count)


class InsufficientDiskError(StoreError):
    """The filesystem lacks the space the corpus needs (plus a margin)."""


@dataclass
class DiskEstimate:
    needed: int
    free: int
    path: str

    @property
    def ok(self) -> bool:
        return self.free >= self.needed


# The estimate, scaled by 64 rows the server counted, came within 0.79x-1.09x of the bytes
# written on the shared fixtures (2026-12-01): 15% covers that sampling error.
DISK_MARGIN = 0.15


def check_disk_space(root: Path, needed_bytes: int, *, force: bool = False, margin: float = DISK_MARGIN) -> DiskEstimate:
    """Refuse (InsufficientDiskError) when `root`'s filesystem lacks `needed_bytes`
    plus `margin`, unless `force`."""
    p = Path(root)
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    need = int(needed_bytes * (1 + margin))
    est = DiskEstimate(needed=need, free=free, path=str(root))
    if not est.ok and not force:
        raise InsufficientDiskError(
            f"the corpus needs about {fmt_bytes(need)} (estimate + {margin:.0%} margin) but "
            f"{root} has {fmt_bytes(free)} free; free space, pick another --output, lower "
            "--max-samples/--max-length, or pass --force-disk to run anyway"
        )
    return est
