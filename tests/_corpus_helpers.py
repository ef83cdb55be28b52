"""Helpers for corpus tests: synthetic `Decoded` responses and a minimal file store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from hsx.wire import Decoded

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
LAYER_IDS = [1, 2, 3, 5]  # stories260K-like: N = 5 layers
HIDDEN = 64
VOCAB = 512


def make_decoded(
    seed: int,
    num_tokens: int,
    *,
    layer_ids: list[int] = LAYER_IDS,
    hidden: int = HIDDEN,
    vocab: int = VOCAB,
    dtype: torch.dtype = torch.bfloat16,
    mask: np.ndarray | None | str = "turns",
) -> Decoded:
    """A deterministic response: random states, random ids, a prompt/answer style mask."""
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(num_tokens, len(layer_ids), hidden, generator=g) * 3).to(dtype)
    ids = torch.randint(0, vocab, (num_tokens,), generator=g).numpy().astype(np.int64)
    if isinstance(mask, str):
        m = np.zeros(num_tokens, dtype=np.uint8)
        m[num_tokens // 3 :] = 1  # context, then an answer
        if num_tokens > 6:
            m[num_tokens // 2 : num_tokens // 2 + 2] = 0  # a second context turn
        mask = m
    meta = {"layer_ids": json.dumps(layer_ids), "hidden_size": str(hidden)}
    return Decoded(hidden_states=hs, token_ids=ids, loss_mask=mask, metadata=meta)


def store_files(out_dir: Path, files: dict[str, bytes]) -> None:
    """What the run loop's store does, minus checksums: tmp + fsync + rename."""
    for rel, data in files.items():
        path = Path(out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "wb") as f:
            for part in data if isinstance(data, (list, tuple)) else [data]:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
