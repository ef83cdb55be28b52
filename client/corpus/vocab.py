"""Draft-vocabulary mapping from supervised-token frequencies.

Selection (same rule as speculators' `build_vocab_mappings_from_distribution`):
the K most frequent supervised tokens (loss_mask == 1), ties in frequency broken toward
the lower id, then sorted ascending by id. If fewer than K distinct tokens were seen, the
set is filled with the lowest ids not yet chosen (0, 1, 2, ...), as speculators and
SpecForge both do. Then `d2t[j] = selected[j] - j` (target id = j + d2t[j]) and `t2d` is a
bool mask over the target vocab with exactly K True entries.

Files:
  speculators: `token_freq.pt` (dict[int, int]), `d2t-{K}.npy` (int64 [K]),
               `t2d-{K}.npy` (bool [V]) at the top of the data directory;
  SpecForge:   `vocab_mapping/vocab_mapping.pt` = {"d2t": int64 [K], "t2d": bool [V]}
               (pass it as `--vocab-mapping`).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Mapping

import numpy as np
import torch


def count_supervised(counter: Counter, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
    """Add the supervised tokens of one sample to `counter`."""
    ids = np.asarray(input_ids).reshape(-1)
    mask = np.asarray(loss_mask).reshape(-1).astype(bool)
    if ids.shape != mask.shape:
        raise ValueError(f"{ids.shape[0]} input ids but {mask.shape[0]} loss-mask entries")
    uniq, counts = np.unique(ids[mask], return_counts=True)
    counter.update(dict(zip(uniq.tolist(), counts.tolist())))


def select_draft_tokens(token_freq: Mapping[int, int], draft_vocab_size: int, vocab_size: int | None) -> np.ndarray:
    """The K selected target ids, ascending (see module doc)."""
    if vocab_size is None:
        raise ValueError("a draft vocab mapping needs the target vocab size")
    k, v = int(draft_vocab_size), int(vocab_size)
    if not 0 < k <= v:
        raise ValueError(f"draft vocab size {k} must be in 1..{v} (the target vocab size)")
    bad = [t for t in token_freq if not 0 <= int(t) < v]
    if bad:
        raise ValueError(f"token ids outside the target vocab of {v}: {sorted(bad)[:5]}")
    ranked = sorted(token_freq, key=lambda t: (-token_freq[t], t))
    chosen = [int(t) for t in ranked[:k]]
    if len(chosen) < k:
        have = set(chosen)
        for t in range(v):
            if len(chosen) >= k:
                break
            if t not in have:
                chosen.append(t)
    return np.array(sorted(chosen), dtype=np.int64)


def build_mappings(token_freq: Mapping[int, int], draft_vocab_size: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [K], t2d bool [V]) with target = j + d2t[j]."""
    sel = select_draft_tokens(token_freq, draft_vocab_size, vocab_size)
    d2t = sel - np.arange(sel.shape[0], dtype=np.int64)
    t2d = np.zeros(int(vocab_size), dtype=bool)
    t2d[sel] = True
    return d2t, t2d


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def speculators_vocab_files(token_freq: Mapping[int, int], draft_vocab_size: int | None, vocab_size: int | None) -> dict[str, bytes]:
    """{relative path: bytes} for speculators: token_freq.pt, and d2t/t2d when K is given."""
    files = {"token_freq.pt": _torch_bytes({int(t): int(c) for t, c in sorted(token_freq.items())})}
    if draft_vocab_size:
        d2t, t2d = build_mappings(token_freq, draft_vocab_size, vocab_size)
        files[f"d2t-{int(draft_vocab_size)}.npy"] = _npy_bytes(d2t)
        files[f"t2d-{int(draft_vocab_size)}.npy"] = _npy_bytes(t2d)
    return files


def specforge_vocab_files(token_freq: Mapping[int, int], draft_vocab_size: int | None, vocab_size: int | None) -> dict[str, bytes]:
    """{relative path: bytes} for SpecForge's vocab_mapping.pt ({} when K is not given)."""
    if not draft_vocab_size:
        return {}
    d2t, t2d = build_mappings(token_freq, draft_vocab_size, vocab_size)
    return {"vocab_mapping/vocab_mapping.pt": _torch_bytes({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)})}

