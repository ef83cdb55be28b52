"""What users install: the wheel ships every package of the four import roots, found by
setup.py rather than listed (a hand-kept list once shipped without hsx/protocol).

The installed wheel itself (serve, extract, verify from outside the checkout, the
Dockerfile's install line, the client alone) is run by scripts/wheel_check.sh in CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from _server import REPO

ROOTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def source_packages(root: Path) -> set[str]:
    """Every folder with an __init__.py under the four roots, by its import name."""
    out = set()
    for name, folder in ROOTS.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            out.add(".".join((name, *rel.parts)))
    return out


def wheel_packages(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {str(Path(n).parent).replace("/", ".") for n in z.namelist() if n.endswith("/__init__.py")}


def build_wheel(src: Path, out: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = out.glob("hsx_hidden_states-*.whl")
    return wheel


def test_the_four_roots_are_mapped_and_no_package_list_is_kept():
    assert ROOTS == {"hsx": "hsx", "hsx_service": "service", "hsx_client": "client", "hsx_tools": "tools"}
    setuptools_table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "packages" not in setuptools_table, "packages are discovered by setup.py, not listed"
    assert "hsx.protocol" in source_packages(REPO)


def test_the_wheel_ships_every_package_and_a_new_one_without_touching_pyproject(tmp_path):
    copy = tmp_path / "src"
    keep = ["pyproject.toml", "setup.py", "README.md", "LICENSE", *ROOTS.values()]
    copy.mkdir()
    for name in keep:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, copy / name)
    new = copy / "client" / "corpus" / "brand_new"
    new.mkdir()
    (new / "__init__.py").write_text("VALUE = 1\n")
    wheel = build_wheel(copy, tmp_path / "dist")
    shipped = wheel_packages(wheel)
    assert source_packages(copy) <= shipped, sorted(source_packages(copy) - shipped)
    assert {"hsx.protocol", "hsx_client.corpus.brand_new"} <= shipped
    assert not {p for p in shipped if p.split(".")[0] not in ROOTS}, "nothing but the four roots ships"
