"""Which layers are captured when nobody says: one function, for the server and the benchmark.

Layer id k is the residual stream after k decoder layers; id N (the number of decoder
layers) is the last layer's output before the final norm (shared/DESIGN.md).
"""

from __future__ import annotations


def default_layers(n: int) -> list[int]:
    """speculators' convention [2, N//2, N-3, N], kept inside 0..N, deduplicated (so a
    shallow model gets fewer than four ids)."""
    return sorted({min(max(k, 0), n) for k in (2, n // 2, n - 3, n)})
