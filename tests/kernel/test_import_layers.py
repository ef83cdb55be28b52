"""Issue 26: imports go only downward. hsx (the kernel) imports neither side nor the tools;
hsx_service and hsx_client never import each other; only hsx_tools may import both.
Read from the source (every import statement, deferred ones too), so a lazy import
inside a function cannot hide a wrong door."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {  # folder -> import names it must not use
    "hsx": ("hsx_service", "hsx_client", "hsx_tools"),
    "service": ("hsx_client", "hsx_tools"),
    "client": ("hsx_service", "hsx_tools"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_only_go_downward(folder):
    wrong = [f"{p.relative_to(REPO)}:{line} imports {name}"
             for p in sorted((REPO / folder).rglob("*.py"))
             for line, name in _imports(p)
             if name.split(".")[0] in FORBIDDEN[folder]]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_deferred_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from hsx_client.shm import attach\n")
    assert _imports(p) == [(2, "hsx_client.shm")]
