"""What an HTTP worker reads in the engine process's answer to its lease request: whether
it is a lease (one range, or the chunked form), and the body the engine process would have
sent, rebuilt from the lease answer's tensors and the states in the arena."""

from __future__ import annotations

import httpx

from hsx.wire import LEASE_MEDIA_TYPE, LEASE_STREAM_MEDIA_TYPE, TensorSpec, WireFormatError, check_body


def is_lease_stream(answer: httpx.Response) -> bool:
    """The chunked lease form: a sample larger than the engine process's stream window."""
    return answer.status_code == 200 and answer.headers.get("content-type") == LEASE_STREAM_MEDIA_TYPE


def is_lease(answer: httpx.Response) -> bool:
    """The engine process granted a lease (else: an error, or a body it sent itself)."""
    return answer.status_code == 200 and answer.headers.get("content-type") == LEASE_MEDIA_TYPE


def rebuild_body(content: bytes, lease: dict, arena) -> tuple[list[TensorSpec], list, dict[str, str]]:
    """The tensors and metadata of the body the engine process would have sent: the
    states (from the arena) first, then the lease answer's tensors, its metadata without
    the lease."""
    header, start = check_body(content)
    view = memoryview(content)
    specs = [TensorSpec("hidden_states", lease["dtype"], tuple(lease["shape"]))]
    parts: list = [arena.view(int(lease["offset"]), int(lease["nbytes"])) if arena is not None else b""]
    if arena is not None and specs[0].nbytes != len(parts[0]):
        raise WireFormatError(f"lease of {lease['nbytes']} bytes for states of shape {lease['shape']}")
    tensors = sorted((e["data_offsets"][0], name, e) for name, e in header.items() if name != "__metadata__")
    for lo, name, e in tensors:
        specs.append(TensorSpec(name, e["dtype"], tuple(e["shape"])))
        parts.append(view[start + lo : start + e["data_offsets"][1]])
    metadata = {k: v for k, v in header.get("__metadata__", {}).items() if k != "lease"}
    return specs, parts, metadata
