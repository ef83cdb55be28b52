"""Load every shared library of an assembled kit the way Python loads extensions (RTLD_NOW:
every undefined symbol resolved at once), after torch, and list the ones that fail.

A library built against a newer CUDA component than the machine's fails here with the
missing symbol's name, before any engine starts. Run with the kit on PYTHONPATH:

    PYTHONPATH=/tmp/site python3 tests/gpu/kit/load_check.py /tmp/site
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path


def elf_libraries(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*.so*")):
        if p.is_file() and not p.is_symlink() and p.open("rb").read(4) == b"\x7fELF":
            out.append(p)
    return out


def linked_from_image(root: Path, p: Path) -> bool:
    parts = p.relative_to(root).parts
    return len(parts) > 2 and parts[0] == "nvidia" and (root / parts[0] / parts[1]).is_symlink()


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "/tmp/site").resolve()
    import torch  # noqa: F401  (libtorch first, as every extension expects)

    # The image's CUDA libraries, linked under nvidia/ by assemble.sh, are not the kit's to check.
    libs = [p for p in elf_libraries(root) if not linked_from_image(root, p)]
    failed = []
    for p in libs:
        try:
            ctypes.CDLL(str(p), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as exc:
            failed.append((p.relative_to(root), " ".join(str(exc).split()).replace(str(root) + "/", "")))
    for rel, why in failed:
        print(f"load_check: FAIL {rel}: {why}")
    print(f"load_check: {len(libs) - len(failed)} of {len(libs)} libraries load with RTLD_NOW "
          f"(torch {torch.__version__} from {Path(torch.__file__).parent.parent})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
