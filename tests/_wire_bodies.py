"""Wire bodies (hsx/wire.py's safetensors file) built in tests, without a server."""

from __future__ import annotations

import json

import numpy as np
import torch

from hsx import wire


def make_body(t=7, layers=4, hidden=5, dtype=torch.bfloat16, mask=True) -> bytes:
    g = torch.Generator().manual_seed(t)
    hs = torch.randn(t, layers, hidden, generator=g).to(dtype)
    ids = np.arange(100, 100 + t, dtype=np.int64)
    specs = [wire.TensorSpec("hidden_states", {torch.bfloat16: "BF16", torch.float32: "F32"}[dtype], (t, layers, hidden)),
             wire.TensorSpec("token_ids", "I64", (t,))]
    parts = [hs.view(torch.uint8).numpy().tobytes(), ids.tobytes()]
    if mask:
        specs.append(wire.TensorSpec("loss_mask", "U8", (t,)))
        parts.append((np.arange(t) % 2).astype(np.uint8).tobytes())
    return wire.encode_header(specs, {"layer_ids": json.dumps([1, 2, 3, 4])}) + b"".join(parts)
