"""Keep only the GPU code one architecture can run in an ELF's CUDA fat binaries.

A CUDA library embeds, in its `.nv_fatbin` section, one fat-binary container per
translation unit; each container holds one cubin per architecture it was built for
(torch 2.14's libtorch_cuda.so: sm_75, 80, 86, 90, 100, 120) and optionally PTX.
A device of compute capability 9.0 (H100/H200) can run only the sm_90/sm_90a
cubins (SASS runs only on its own major version) and PTX of compute_90 or older
(JIT-compiled). This tool moves those entries to the front of each container,
shrinks the container's size field and zeroes the rest, so the driver sees a
container as if it had been built for that architecture alone, and the zeroed
bytes cost nothing once compressed. Container positions never move, so nothing
that points at them changes. A container with nothing usable is left untouched
(the driver finds no image there, exactly as before). Anything that does not
parse exactly as expected leaves the file unmodified and exits non-zero.

    python fatbin_prune.py --arch 90 FILE...        # in place
    python fatbin_prune.py --arch 90 --dry-run FILE...
"""

from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass

MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
# .nv_fatbin: what the CUDA runtime registers; __nv_relfatbin: relocatable device code kept
# beside it by separate compilation (-rdc, e.g. NCCL), same container format.
FATBIN_SECTIONS = (b".nv_fatbin", b"__nv_relfatbin")


class FormatError(ValueError):
    pass


@dataclass
class Stats:
    containers: int = 0
    entries: int = 0
    kept: int = 0
    untouched: int = 0  # containers with nothing usable, left as they were
    bytes_before: int = 0
    bytes_after: int = 0


def fatbin_sections(elf: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every fat-binary section of a little-endian ELF64 file."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise FormatError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    def sh(i):
        return struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
    str_off = sh(shstrndx)[4]
    out = []
    for i in range(shnum):
        name, _typ, _flags, _addr, off, size, *_ = sh(i)
        end = elf.index(b"\0", str_off + name)
        if elf[str_off + name:end] in FATBIN_SECTIONS:
            out.append((off, size))
    return out


def usable(kind: int, arch: int, target: int) -> bool:
    if kind == KIND_ELF:
        return arch == target  # sm_90 and sm_90a both carry 90
    if kind == KIND_PTX:
        return arch <= target
    return False


def prune_container(buf: bytearray, pos: int, target: int, st: Stats) -> int:
    """Prune the container at `pos` in place; return the offset just past it."""
    magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", buf, pos)
    if magic != MAGIC or hsize != 16:
        raise FormatError(f"no fat-binary container at {pos:#x}")
    start, end = pos + hsize, pos + hsize + fsize
    if end > len(buf):
        raise FormatError(f"container at {pos:#x} runs past its section")
    entries = []
    e = start
    while e < end:
        kind, _v, ehs, psize = struct.unpack_from("<HHIQ", buf, e)
        arch, = struct.unpack_from("<I", buf, e + 28)
        if ehs < 64 or e + ehs + psize > end:
            raise FormatError(f"bad entry at {e:#x}")
        entries.append((e, ehs + psize, kind, arch))
        e += ehs + psize
    if e != end:
        raise FormatError(f"entries of the container at {pos:#x} do not end at its size")
    st.containers += 1
    st.entries += len(entries)
    st.bytes_before += fsize
    keep = [(o, n) for o, n, kind, arch in entries if usable(kind, arch, target)]
    if not keep:
        st.untouched += 1
        st.bytes_after += fsize
        return end
    st.kept += len(keep)
    packed = b"".join(bytes(buf[o:o + n]) for o, n in keep)
    buf[start:start + len(packed)] = packed
    buf[start + len(packed):end] = bytes(end - start - len(packed))
    struct.pack_into("<Q", buf, pos + 8, len(packed))
    st.bytes_after += len(packed)
    return end


def prune_section(buf: bytearray, off: int, size: int, target: int, st: Stats) -> None:
    pos, stop = off, off + size
    while pos < stop:
        if struct.unpack_from("<I", buf, pos)[0] == MAGIC:
            pos = prune_container(buf, pos, target, st)
            continue
        if buf[pos] != 0:  # only zero padding may sit between containers
            raise FormatError(f"unexpected byte at {pos:#x} between containers")
        pos += 1


def prune_file(path: str, target: int, dry_run: bool = False) -> Stats:
    with open(path, "rb") as f:
        data = f.read()
    st = Stats()
    buf = bytearray(data)
    for off, size in fatbin_sections(data):
        # Work on a copy of the section so a format error leaves nothing half done.
        sec = bytearray(buf[off:off + size])
        prune_section(sec, 0, size, target, st)
        buf[off:off + size] = sec
    if not dry_run and st.containers:
        with open(path, "r+b") as f:
            f.write(buf)
    return st


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 to keep (90: H100/H200)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    rc = 0
    for path in a.files:
        try:
            st = prune_file(path, a.arch, a.dry_run)
        except FormatError as exc:
            print(f"fatbin_prune: {path}: left unmodified: {exc}", file=sys.stderr)
            rc = 1
            continue
        if st.containers:
            print(f"{path}: {st.containers} containers, kept {st.kept} of {st.entries} entries "
                  f"({st.untouched} containers without sm_{a.arch} code left as they were), "
                  f"GPU code {st.bytes_before / 2**20:.1f} -> {st.bytes_after / 2**20:.1f} MiB")
    return rc


if __name__ == "__main__":
    sys.exit(main())
