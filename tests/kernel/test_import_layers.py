"""Issue 26 and 37: imports go only downward. hsx (the kernel) imports neither side nor the
tools; hsx_service and hsx_client never import each other; only hsx_tools may import both.
Inside the service the rooms point one way: core imports no other room; engine, body,
serving and everything else below the HTTP room never import http (only lifecycle.py and
cli.py, which start it, do). Inside the client the library imports none of its rooms.
Read from the source (every import statement, deferred and relative ones too), so a lazy
import inside a function or a `from .x import y` cannot hide a wrong door."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"hsx": "hsx", "service": "hsx_service", "client": "hsx_client", "tools": "hsx_tools"}
FORBIDDEN = {  # folder -> import names it must not use
    "hsx": ("hsx_service", "hsx_client", "hsx_tools"),
    "service": ("hsx_client", "hsx_tools"),
    "client": ("hsx_service", "hsx_tools"),
}
# Rooms inside a package: (importer, what it may not import, its exceptions). A module
# counts as the importer when its dotted name is the importer or starts with it plus ".".
ROOM_RULES = [
    ("hsx_service.core", ("hsx_service.engine", "hsx_service.body", "hsx_service.http", "hsx_service.serving",
                          "hsx_service.lifecycle", "hsx_service.cli", "hsx_service.settings",
                          "hsx_service.tokenize", "hsx_service.tokenize_pool", "hsx_service.chat_content",
                          "hsx_service.text_bounds"), ()),
    ("hsx_service", ("hsx_service.http",), ("hsx_service.http", "hsx_service.lifecycle", "hsx_service.cli")),
    ("hsx_service.body", ("hsx_service.engine", "hsx_service.serving"), ()),
    ("hsx_client", ("hsx_client.corpus", "hsx_client.training", "hsx_client.regenerate"),
     ("hsx_client.corpus", "hsx_client.training", "hsx_client.regenerate")),
]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _module_name(path: Path) -> str | None:
    """The dotted name a repo file is imported under (service/http/app.py -> hsx_service.http.app)."""
    try:
        rel = path.resolve().relative_to(REPO)
    except ValueError:
        return None
    if rel.parts[0] not in PACKAGES:
        return None
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:-1]]
    if rel.stem != "__init__":
        parts.append(rel.stem)
    return ".".join(parts)


def _package(path: Path) -> str | None:
    name = _module_name(path)
    if name is None:
        return None
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, relative imports resolved against its package (`from . import
    x` names the package's x as well as the package)."""
    package = _package(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):
            assert package is not None, f"{path}: a relative import outside the packages"
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            module = f"{base}.{node.module}" if node.module else base
            out.append((node.lineno, module))
            if not node.module:
                out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_only_go_downward(folder):
    wrong = [f"{p.relative_to(REPO)}:{line} imports {name}"
             for p in _sources(folder)
             for line, name in _imports(p)
             if name.split(".")[0] in FORBIDDEN[folder]]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("importer, forbidden, exempt", ROOM_RULES, ids=[r[0] for r in ROOM_RULES])
def test_rooms_point_one_way(importer, forbidden, exempt):
    folder = next(f for f, pkg in PACKAGES.items() if _within(importer, pkg))
    wrong = [f"{p.relative_to(REPO)}:{line} imports {name}"
             for p in _sources(folder)
             if _within(_module_name(p), importer) and not any(_within(_module_name(p), e) for e in exempt)
             for line, name in _imports(p)
             if any(_within(name, f) for f in forbidden)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_deferred_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from hsx_client.shm import attach\n")
    assert _imports(p) == [(2, "hsx_client.shm")]


def test_the_checker_resolves_relative_imports():
    assert _module_name(REPO / "service/http/app.py") == "hsx_service.http.app"
    found = dict((name, line) for line, name in _imports(REPO / "client/regenerate/cli.py"))
    assert "hsx_client.regenerate.run" in found  # `from .run import ...`
    assert _package(REPO / "service/engine/__init__.py") == "hsx_service.engine"


def test_the_room_rules_catch_a_wrong_door(tmp_path, monkeypatch):
    """A core module importing the HTTP room, relatively, is caught."""
    (tmp_path / "service" / "core").mkdir(parents=True)
    bad = tmp_path / "service" / "core" / "oops.py"
    bad.write_text("from ..http.errors import render\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert (1, "hsx_service.http.errors") in _imports(bad)
    with pytest.raises(AssertionError, match="oops.py:1 imports hsx_service.http.errors"):
        test_rooms_point_one_way(*ROOM_RULES[0])
