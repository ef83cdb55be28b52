"""Strip symbol tables from ELF files, keeping a file stripped only when the loader would
see exactly what it saw before: the same program headers (every LOAD segment's address,
sizes, flags and alignment). `strip` mangles some post-processed wheels' libraries (extra
LOAD segments added by patchelf, e.g. torchvision's image_stable.so: "ELF load command
address/offset not page-aligned"); those stay as they were.

    python safe_strip.py FILE...
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile


def segments(path: str) -> list[tuple[int, ...]]:
    """(type, flags, vaddr, filesz, memsz, align, offset % align) of every program header."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            raise ValueError("not an ELF64 file")
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    out = []
    for i in range(phnum):
        typ, flags, off, vaddr, _paddr, filesz, memsz, align = struct.unpack_from("<IIQQQQQQ", table, i * phentsize)
        out.append((typ, flags, vaddr, filesz, memsz, align, off % align if align > 1 else 0))
    return out


def strip_one(path: str) -> bool:
    """Strip `path` in place if that leaves its segments unchanged; return whether it did."""
    before = segments(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".strip-")
    os.close(fd)
    try:
        subprocess.run(["strip", "--strip-unneeded", "-o", tmp, path], check=True, capture_output=True)
        if segments(tmp) != before:
            return False
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(paths: list[str]) -> int:
    kept = []
    saved = 0
    for p in paths:
        size = os.path.getsize(p)
        try:
            ok = strip_one(p)
        except (ValueError, subprocess.CalledProcessError) as exc:
            print(f"safe_strip: {p}: left as it was ({exc})", file=sys.stderr)
            ok = False
        if ok:
            saved += size - os.path.getsize(p)
        else:
            kept.append(p)
    print(f"safe_strip: {len(paths) - len(kept)} of {len(paths)} stripped, {saved / 2**20:.0f} MiB less; "
          f"left as they were (stripping would change their segments): {' '.join(kept) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
