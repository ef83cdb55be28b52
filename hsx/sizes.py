"""Sizes in bytes as people write them (`4GiB`, `512MiB`, `800MB`, `1e9`): one parser for the
client's `--max-buffer-bytes` and the server's byte settings (`--arena-bytes`, ...), and the
two ways hsx prints a size: exact (`format_bytes`, a setting read back) and rounded
(`fmt_bytes`, a measure in a message, a progress line or a report)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """`4GiB`, `512MiB`, `1e9`, `800MB` -> bytes; ValueError for anything else or <= 0."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    try:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else 0
    except (KeyError, ValueError):
        n = 0
    if n <= 0:
        raise ValueError(f"{text!r} is not a positive size (e.g. 512MiB, 4GiB)")
    return n


def format_bytes(n: int) -> str:
    """65536 -> `64 KiB`, 1 << 30 -> `1 GiB`: the largest binary unit that divides `n`
    (as `parse_bytes` reads it back), else the plain count."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def fmt_bytes(n: float | None) -> str:
    """1500 -> `1.5 KB`, 3.2e9 -> `3.2 GB`: rounded to a decimal unit, as disks and `df -H`
    state sizes; `-` for None (nothing measured). Every message, progress line and report
    prints sizes with it; `format_bytes` is for a setting's exact value."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)
