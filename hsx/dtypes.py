"""The one table of tensor dtypes: torch names, safetensors codes and element sizes.

The wire format, the corpus formats, the server's byte counts and the benchmark all
read it; torch itself is imported only by `torch_dtype`, so the client's light imports
stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    name: str  # torch name without the prefix: bfloat16, float16, float32, int64, uint8, float8_e4m3fn
    st: str  # safetensors code: BF16, F16, F32, I64, U8, F8_E4M3
    itemsize: int


_ALL = (
    DType("bfloat16", "BF16", 2),
    DType("float16", "F16", 2),
    DType("float32", "F32", 4),
    DType("int64", "I64", 8),
    DType("uint8", "U8", 1),
    DType("float8_e4m3fn", "F8_E4M3", 1),  # fp8 corpora (`hsx extract --dtype fp8`), never served
)
BY_NAME = {d.name: d for d in _ALL}
BY_ST = {d.st: d for d in _ALL}
# The dtypes a served model's states can have (vLLM's --dtype spellings map onto them).
STATE_DTYPES = ("bfloat16", "float16", "float32")
_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def by_name(name: str) -> DType:
    """`name` as torch spells it (`torch.bfloat16` or `bfloat16`) or as vLLM's --dtype does (`half`)."""
    key = str(name).removeprefix("torch.")
    try:
        return BY_NAME[_ALIASES.get(key, key)]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (known: {', '.join(BY_NAME)})") from None


def st_code(name: Any) -> str:
    """The safetensors code of a torch dtype or dtype name."""
    return by_name(str(name)).st


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, by_name(name).name)
