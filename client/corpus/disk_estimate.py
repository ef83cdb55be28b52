"""The disk a run will need, estimated before it starts.

Token estimate for the disk check: `input_ids` length, else characters / 3 of the prompt,
messages and tools (+8 per message), capped at `--max-length` and the server's
max_model_len, then scaled by the served tokenizer's real counts: up to COUNT_SAMPLE
planned samples are tokenized by the server (`POST /tokenize`, no prefill); the ratio of
their real to estimated tokens (before truncation) scales each estimate before the cap,
and the share of tokens in rows that will be dropped is taken off (characters / 3 alone
was 0.5x to 1.4x off on the shared fixtures with a 512-token vocab).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


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
                max_model_len: int | None, token_ratio: float = 1.0, kept: float = 1.0) -> int:
    """Bytes the samples of `requests` will take: estimated tokens (x `token_ratio`, the
    served tokenizer's real / estimated count, then capped; x `kept`, the share not dropped)
    x the format's bytes per token, plus 4 KiB a sample for headers and file-system slack."""
    total = 0.0
    count = 0
    cap = min((int(c) for c in (max_length, max_model_len) if c), default=None)
    for r in requests:
        n = estimate_tokens(r, None, None) * token_ratio
        total += min(n, cap) if cap else n
        count += 1
    return int(total * kept * float(bytes_per_token) + 4096 * count)
