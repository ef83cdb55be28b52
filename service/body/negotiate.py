"""Content negotiation, the one place Accept and Accept-Encoding are read: which coding a
body gets (`choose_coding`) and whether a client asked for a media type (a lease, bf16split).

Both headers are RFC 9110 lists of `name;param=value` with an optional weight `q` (0 to 1,
default 1; q=0 means "not this"), parsed here, never tested as substrings: a client that
says `application/vnd.hsx.lease+safetensors;q=0` refuses a lease.
"""

from __future__ import annotations


def weights(header: str | None) -> dict[str, float]:
    """Lower-cased names -> q. A malformed or out-of-range q counts as 0 (refused); a name
    listed twice keeps its first weight."""
    out: dict[str, float] = {}
    for part in (header or "").split(","):
        name, *params = (x.strip() for x in part.split(";"))
        if not name:
            continue
        q = 1.0
        for prm in params:
            key, _, value = prm.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
                if not 0.0 <= q <= 1.0:
                    q = 0.0
        out.setdefault(name.lower(), q)
    return out


def accepts_encoding(accept_encoding: str | None, coding: str) -> bool:
    """`coding` named with q > 0, or, when not named, `*` with q > 0."""
    w = weights(accept_encoding)
    return w.get(coding, w.get("*", 0.0)) > 0


def accepts_media(accept: str | None, media_type: str) -> bool:
    """`media_type` named with q > 0: no wildcard, each of hsx's media types is an opt-in."""
    return weights(accept).get(media_type.lower(), 0.0) > 0


def choose_coding(accept: str | None, accept_encoding: str | None, dtype: str) -> str:
    """identity | zstd | bf16split. bf16split only when asked for in Accept, the states
    are bf16, and zstd is acceptable (its frames are zstd); else zstd when accepted."""
    from hsx import bf16split

    zstd = accepts_encoding(accept_encoding, "zstd")
    if zstd and dtype == "bfloat16" and accepts_media(accept, bf16split.MEDIA_TYPE):
        return "bf16split"
    return "zstd" if zstd else "identity"
