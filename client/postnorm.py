"""The target model's final norm, applied on the client.

The server returns the last layer **before** the final norm (layer id N). SpecForge's
offline format wants it **after** the norm, so the client applies the norm itself with
the weights the server publishes.

The computation is done in float32 end to end (normalize, scale by the weight) and cast
back to the input dtype once at the end. HF Llama casts to the model dtype *before* the
weight multiply; the two differ by at most one rounding step of the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

NormStyle = Literal["rms", "gemma"]


@dataclass
class FinalNorm:
    """RMSNorm parameters: `weight` float32 [H], `eps`, and `style`.

    style "rms": y = x / rms(x) * w  (Llama, Qwen, Mistral, ...)
    style "gemma": y = x / rms(x) * (1 + w)
    """

    weight: np.ndarray
    eps: float
    style: NormStyle = "rms"

    def __post_init__(self) -> None:
        w = np.asarray(self.weight, dtype=np.float32)
        if w.ndim != 1 or w.size == 0:
            raise ValueError(f"final norm weight must be a non-empty vector, got shape {w.shape}")
        self.weight = w
        self.eps = float(self.eps)
        if not self.eps > 0:
            raise ValueError(f"final norm eps must be > 0, got {self.eps}")
        if self.style not in ("rms", "gemma"):
            raise ValueError(f"final norm style must be 'rms' or 'gemma', got {self.style!r}")

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[0])


def apply_final_norm(x: torch.Tensor, norm: FinalNorm) -> torch.Tensor:
    """Apply `norm` over the last dim of `x` in float32; returns `x.dtype`."""
    if x.shape[-1] != norm.hidden_size:
        raise ValueError(f"final norm has hidden size {norm.hidden_size}, states have {x.shape[-1]}")
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    y = xf * torch.rsqrt(var + norm.eps)
    w = torch.from_numpy(norm.weight).to(device=x.device)
    if norm.style == "gemma":
        w = 1.0 + w
    return (y * w).to(x.dtype)
