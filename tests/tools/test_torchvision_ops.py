"""PyPI's torchvision (a CUDA build) beside the CPU torch: the two ways hsx makes it importable
(hsx/compat.py) work in fresh processes: the .pth file scripts/install.sh puts in the venv,
and `hsx` commands' guard passed on to child processes (vLLM's engine and workers). Its
transforms run; its C++ ops are absent, and say so when called."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
USE_IT = ("import torch, torchvision\n"
          "from torchvision.transforms.v2 import functional as F\n"
          "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor\n"
          "assert F.resize(torch.rand(3, 64, 48), [32, 24]).shape == (3, 32, 24)\n"
          "try:\n    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
          "except (NotImplementedError, RuntimeError) as e:\n    print('nms:', type(e).__name__)\n")


@pytest.fixture(autouse=True)
def _torchvision_installed():
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (scripts/install.sh installs it)")


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def _unguarded_env() -> dict[str, str]:
    """This process's environment without a guard an earlier test's in-process `hsx` command
    applied to it (GUARD_ENV and GUARD_DIR on PYTHONPATH): the child must decide for itself."""
    from hsx.compat import GUARD_DIR, GUARD_ENV

    env = {k: v for k, v in os.environ.items() if k != GUARD_ENV}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != GUARD_DIR]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def test_the_install_pth_makes_torchvision_importable_in_a_fresh_process(tmp_path):
    (tmp_path / "hsx-torchvision-ops.pth").write_text((ROOT / "scripts" / "hsx-torchvision-ops.pth").read_text())
    r = _run(f"import site; site.addsitedir({str(tmp_path)!r})\n" + USE_IT, dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_guard_of_hsx_commands_reaches_child_processes():
    code = ("import os, subprocess, sys\n"
            "from hsx.compat import guard_broken_torch_extensions, GUARD_ENV\n"
            "applied = guard_broken_torch_extensions()\n"
            "print('guard:', applied, os.environ.get(GUARD_ENV))\n"
            f"sys.exit(subprocess.run([sys.executable, '-c', {USE_IT!r}]).returncode)\n")
    r = _run(code, _unguarded_env())
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    # Applied (a CUDA torchvision beside the CPU torch) or not needed (it loads as installed)
    assert "guard: True torchvision-ops" in r.stdout or "guard: False None" in r.stdout, r.stdout
