"""Which layers are captured when nobody says: one function, for the server and the benchmark.

Layer id k is the residual stream after k decoder layers; id N (the number of decoder
layers) is the last layer's output before the final norm (shared/DESIGN.md).
"""

from __future__ import annotations

EAGLE3_AUX_LAYERS = 3  # an EAGLE-3 draft takes three auxiliary layers plus the last one


def default_layers(n: int) -> list[int]:
    """A valid EAGLE-3 set whenever the model allows it: 3 distinct auxiliary ids < N, plus N.

    Start from speculators' convention [2, N//2, N-3] (so N >= 8 gives exactly
    [2, N//2, N-3, N]), clip each to 1..N-1, and replace a collision by the smallest unused
    id >= 1, then 0: N=5 -> [1, 2, 3, 5], N=4 -> [1, 2, 3, 4], N=3 -> [0, 1, 2, 3]. Why:
    deduplicating instead (the old rule) left a 5-layer model with [2, 5], which no EAGLE-3
    corpus can use, and every sample of a first run failed. Below N=3 there are not three
    auxiliary ids: all of 0..N are served and the client refuses EAGLE-3 formats up front.
    """
    if n < EAGLE3_AUX_LAYERS:
        return list(range(n + 1))
    aux: list[int] = []
    for k in (2, n // 2, n - 3):
        k = min(max(k, 1), n - 1)
        if k in aux:
            k = next((c for c in [*range(1, n), 0] if c not in aux), k)
        aux.append(k)
    return sorted(aux) + [n]


# The layer set each draft's trainer reads (client/corpus/drafts.py computes them; `hsx
# serve --layers` help and the README show this line; a test holds them together).
DRAFT_LAYER_SETS = (
    "per draft (hsx extract --draft D --format F): eagle3, peagle, dflash, dspark with speculators: "
    "2,N//2,N-3,N; mtp (speculators): N; dflash, domino with specforge: N//2+1; dspark with specforge: N//2+1,N"
)
