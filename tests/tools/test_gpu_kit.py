"""The GPU kit's tools (tests/gpu/kit): fat-binary pruning, safe stripping, the kit spec
(fast tier: synthetic ELF files and one real shared library, no GPU)."""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
import struct
import sys
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parents[1] / "gpu" / "kit"
sys.path.insert(0, str(KIT))
import fatbin_prune  # noqa: E402
import safe_strip  # noqa: E402


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = struct.pack("<HHIQ", kind, 0x0101, 64, len(payload)) + struct.pack("<IIII", len(payload), 0, 0x10008, arch)
    return header + bytes(64 - len(header)) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin_prune.MAGIC, 1, 16, len(body)) + body


def elf_with(section: bytes, name: bytes = b".nv_fatbin") -> bytes:
    """A minimal ELF64 file: header, one data section, the section-name table, section headers."""
    shstr = b"\0" + name + b"\0.shstrtab\0"
    data_off = 64
    shstr_off = data_off + len(section)
    shoff = (shstr_off + len(shstr) + 7) // 8 * 8
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)
    sh = bytes(64)
    sh += struct.pack("<IIQQQQIIQQ", 1, 1, 2, 0, data_off, len(section), 0, 0, 8, 0)
    sh += struct.pack("<IIQQQQIIQQ", 1 + len(name) + 1, 3, 0, 0, shstr_off, len(shstr), 0, 0, 1, 0)
    body = bytes(header) + section + shstr
    return body + bytes(shoff - len(body)) + sh


def test_prune_keeps_sm90_cubins_and_old_ptx_and_zeroes_the_rest(tmp_path):
    sm80, sm90, sm90a, sm100 = entry(2, 80, b"A" * 100), entry(2, 90, b"B" * 40), entry(2, 90, b"C" * 8), entry(2, 100, b"D" * 200)
    ptx80, ptx100 = entry(1, 80, b"P" * 24), entry(1, 100, b"Q" * 24)
    only_sm100 = container(entry(2, 100, b"E" * 32))
    section = container(sm80, sm90, ptx80, sm100, sm90a, ptx100) + bytes(8) + only_sm100
    path = tmp_path / "lib.so"
    path.write_bytes(elf_with(section))
    st = fatbin_prune.prune_file(str(path), 90)
    assert (st.containers, st.entries, st.kept, st.untouched) == (2, 7, 3, 1)
    out = path.read_bytes()[64:64 + len(section)]
    size, = struct.unpack_from("<Q", out, 8)
    assert out[16:16 + size] == sm90 + ptx80 + sm90a  # kept in order, container shrunk to them
    assert set(out[16 + size:len(section) - len(only_sm100) - 8]) == {0}  # the rest is zeros
    assert out.endswith(only_sm100)  # nothing usable: left exactly as it was
    again = fatbin_prune.prune_file(str(path), 90)  # idempotent
    assert (again.kept, again.bytes_after) == (3, st.bytes_after)
    assert path.read_bytes()[64:64 + len(section)] == out


def test_relocatable_fatbin_sections_are_pruned_too(tmp_path):
    path = tmp_path / "librdc.so"
    path.write_bytes(elf_with(container(entry(2, 75, b"x" * 16), entry(2, 90, b"y" * 16)), name=b"__nv_relfatbin"))
    assert fatbin_prune.prune_file(str(path), 90).kept == 1


def test_an_unexpected_layout_leaves_the_file_unmodified(tmp_path, capsys):
    bad = bytearray(container(entry(2, 90, b"B" * 40)))
    struct.pack_into("<Q", bad, 8, 9999)  # container size past the section
    path = tmp_path / "bad.so"
    original = elf_with(bytes(bad) + bytes(8) + container(entry(2, 80, b"A" * 8)))
    path.write_bytes(original)
    assert fatbin_prune.main(["--arch", "90", str(path)]) == 1
    assert path.read_bytes() == original
    assert "left unmodified" in capsys.readouterr().err


def test_safe_strip_keeps_a_real_library_loadable(tmp_path):
    spec = importlib.util.find_spec("zstandard.backend_c") or importlib.util.find_spec("_ctypes")
    src = Path(spec.origin)
    lib = tmp_path / src.name
    shutil.copy(src, lib)
    before = safe_strip.segments(str(lib))
    safe_strip.strip_one(str(lib))
    assert safe_strip.segments(str(lib)) == before
    ctypes.CDLL(str(lib))


def test_safe_strip_refuses_when_segments_would_change(tmp_path, monkeypatch):
    lib = tmp_path / "lib.so"
    shutil.copy(Path(importlib.util.find_spec("_ctypes").origin), lib)
    original = lib.read_bytes()
    calls = iter([[(1, 5, 0, 10, 10, 4096, 0)], [(1, 5, 0, 9, 10, 4096, 0)]])
    monkeypatch.setattr(safe_strip, "segments", lambda p: next(calls))
    assert safe_strip.strip_one(str(lib)) is False
    assert lib.read_bytes() == original


def test_kit_spec_is_pinned_and_every_line_is_known():
    for spec in KIT.glob("vllm-*.txt"):
        for line in spec.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            kind, *items = line.split("#")[0].split()
            assert kind in ("core", "deps", "boot", "drop"), line
            if kind != "drop":
                assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9.+]*", it) for it in items), line


def test_gpu_scripts_pass_shellcheck():
    scripts = sorted(KIT.parent.glob("*.sh")) + sorted(KIT.glob("*.sh"))
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run([shellcheck, "-S", "warning", *map(str, scripts)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout
