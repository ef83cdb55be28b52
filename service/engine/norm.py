"""The final norm's weight, epsilon and style, read from the checkpoint files.

Clients need them to turn the pre-norm last-layer states into post-norm ones
(SpecForge's `hidden_state`). Read from the safetensors files in the API
process: no RPC into the engine, works for every TP size (the norm is replicated).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

# Gemma-family RMSNorm multiplies by (1 + w).
GEMMA_TYPES = {"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text"}
_FINAL_NORM = re.compile(r"^(?:.*\.)?(?:model|transformer|language_model)\.(?:norm|final_layernorm|ln_f)\.weight$")


@dataclass
class CheckpointNorm:
    weight: np.ndarray  # float32 [H]
    eps: float
    style: str  # "rms" | "gemma"
    tensor_name: str


def _local_dir(model: str, revision: str | None) -> str:
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"], local_files_only=True)


def load_final_norm(model: str, revision: str | None, text_config) -> CheckpointNorm:
    from safetensors import safe_open

    directory = _local_dir(model, revision)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    else:
        files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
        weight_map = {}
        for name in files:
            with safe_open(os.path.join(directory, name), "np") as f:
                weight_map.update({k: name for k in f.keys()})
    candidates = sorted((k for k in weight_map if _FINAL_NORM.match(k) and ".layers." not in k), key=len)
    if not candidates:
        raise FileNotFoundError(f"no final norm weight (e.g. model.norm.weight) in {directory}")
    name = candidates[0]
    import torch

    with safe_open(os.path.join(directory, weight_map[name]), "pt") as f:  # reads this tensor only
        weight = f.get_tensor(name).to(torch.float32).numpy()
    eps = getattr(text_config, "rms_norm_eps", None) or getattr(text_config, "layer_norm_eps", None) or 1e-6
    style = "gemma" if getattr(text_config, "model_type", "") in GEMMA_TYPES else "rms"
    return CheckpointNorm(weight=weight, eps=float(eps), style=style, tensor_name=name)
