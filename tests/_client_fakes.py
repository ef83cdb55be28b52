"""Stand-ins for HsxClient's tests: a /hidden_states body of known content, a URL nothing listens on."""

from __future__ import annotations

import json
import socket

import numpy as np

from hsx import wire

L, H = 4, 8


def make_body(ids: list[int], request_id: str = "rid") -> bytes:
    t = len(ids)
    hs = np.arange(t * L * H, dtype=np.float32).reshape(t, L, H)
    tok = np.asarray(ids, dtype=np.int64)
    mask = np.ones(t, dtype=np.uint8)
    specs = [
        wire.TensorSpec("hidden_states", "F32", (t, L, H)),
        wire.TensorSpec("token_ids", "I64", (t,)),
        wire.TensorSpec("loss_mask", "U8", (t,)),
    ]
    meta = {"layer_ids": json.dumps([2, 4, 6, 8]), "request_id": request_id, "format": wire.FORMAT}
    return wire.encode_header(specs, meta) + hs.tobytes() + tok.tobytes() + mask.tobytes()


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens: connection refused
    return f"http://127.0.0.1:{port}"
