"""Issue 37: the library's front door. `from hsx_client import HsxClient, ...` works for every
name of `__all__`, importing hsx_client alone loads none of the library (the `hsx` command and
every worker import it), and the library's rooms that use it (regenerate, training) use only
public names: of the library and of the corpus package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hsx_client

REPO = Path(__file__).resolve().parents[3]
USERS = ("client/regenerate", "client/training")  # the rooms held to public names


def test_the_front_door_names():
    from hsx_client import (HsxClient, HsxError, RetriesExhaustedError, SampleStream, ServerBusyError,  # noqa: F401
                            ServerSet, ServersUnreachableError)
    from hsx_client.api import HsxClient as at_home

    assert HsxClient is at_home
    assert hsx_client.__all__ == sorted(set(hsx_client.__all__))
    for name in hsx_client.__all__:
        value = getattr(hsx_client, name)
        if name.endswith("Error"):
            assert issubclass(value, HsxError), name
    assert set(hsx_client.__all__) <= set(dir(hsx_client))


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        hsx_client.Nope  # noqa: B018
    from hsx_client import shm  # a module of the library, not a front-door name

    assert shm.__name__ == "hsx_client.shm"


def test_importing_the_package_loads_none_of_the_library():
    code = ("import sys, hsx_client; print(sorted(m for m in sys.modules "
            "if m.startswith(('hsx_client.', 'httpx', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _private_uses(path: Path) -> list[str]:
    """Underscore names a file takes from hsx_client: imported (`from hsx_client.x import _y`,
    a module `_x`), or read off a name imported from it or off a client (`client._pool`)."""
    tree = ast.parse(path.read_text(), str(path))
    bound = {"client"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("hsx_client"):
            names = [*node.module.split("."), *(a.name for a in node.names)]
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.startswith("_")]
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("hsx_client"):
                    found += [f"{path.name}:{node.lineno} imports {a.name}" for n in a.name.split(".")
                              if n.startswith("_")]
                    bound.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
            if owner in bound:
                found.append(f"{path.name}:{node.lineno} reads {owner}.{node.attr}")
    return found


def test_regenerate_and_training_use_only_public_names():
    files = [p for folder in USERS for p in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 5
    assert [use for p in files for use in _private_uses(p)] == []


def test_the_checker_sees_private_uses(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from hsx_client.corpus import inputs as _in\nfrom hsx_client.corpus.inputs import _classify\n"
                   "import hsx_client._hidden\n"
                   "async def f(client, rt):\n    _in._open_source('x')\n    await client._pool.with_retries()\n"
                   "    rt.client._get_json()\n    self._mine()\n")
    assert sorted(u.split(" ", 1)[1] for u in _private_uses(bad)) == [
        "imports _classify", "imports hsx_client._hidden", "reads _in._open_source", "reads client._get_json",
        "reads client._pool"]
