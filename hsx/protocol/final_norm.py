"""The `GET /final_norm` body: the final norm's float32 weight as a one-tensor safetensors
file, its epsilon, style and checkpoint tensor name in the metadata. The server encodes it
(hsx_service.http), the client decodes it (hsx_client.api); one owner of the layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hsx.wire import TensorSpec, encode_header, parse_header


@dataclass
class NormBody:
    weight: np.ndarray  # float32 [H]
    eps: float
    style: str  # "rms" | "gemma"
    tensor_name: str = ""


def encode(weight: np.ndarray, eps: float, style: str, tensor_name: str) -> bytes:
    data = np.asarray(weight).astype("float32").tobytes()
    header = encode_header([TensorSpec("weight", "F32", (len(weight),))],
                           {"eps": repr(eps), "style": style, "tensor": tensor_name})
    return header + data


def decode(body: bytes) -> NormBody:
    import safetensors.numpy

    header, _ = parse_header(body)
    meta = header.get("__metadata__", {}) or {}
    weight = safetensors.numpy.load(body)["weight"].astype("float32", copy=False)
    return NormBody(weight, float(meta.get("eps", "1e-6")), meta.get("style", "rms"), meta.get("tensor", ""))
