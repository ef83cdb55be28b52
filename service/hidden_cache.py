"""Reading captured hidden states out of the cache-only layer's KV pages (pure torch).

`extract_hidden_states` writes token t's states, all captured layers at once, into
slot `block_id * block_size + t % block_size` of one cache-only attention layer
whose "heads" are the captured layers and whose head size is the hidden size. The
per-layer view vLLM hands the connector is 4-D; where its block-offset axis sits
depends on the release (`vllm_compat.hidden_states_block_axis`):

    axis 1: [num_blocks, block_size, num_layers, hidden]   (vLLM < 0.29, "NHD")
    axis 2: [num_blocks, num_layers, block_size, hidden]   (vLLM >= 0.29, logical
            [B, H, N, C] whatever the physical layout, e.g. "LBNHC")

The view may split a scheduler block into equal kernel blocks (hybrid models, whose
scheduler block size is bumped): slot numbers are the same in both, so the gather
divides by the view's own block size, never the scheduler's.
"""

from __future__ import annotations

import torch


def check_view(shape: tuple[int, ...], block_axis: int, num_layers: int, hidden_size: int, block_size: int) -> None:
    """Raise ValueError (one line, with the reason) unless `shape` is the hidden-states view
    this release writes: the layers and hidden size where expected and a kernel block size
    that divides the scheduler's block size."""
    if len(shape) != 4 or block_axis not in (1, 2):
        raise ValueError(f"hsx: hidden-states cache view {tuple(shape)} is not 4-D [blocks, ., ., hidden]")
    layers_axis = 3 - block_axis
    kernel_block = shape[block_axis]
    if shape[layers_axis] != num_layers or shape[3] != hidden_size or kernel_block <= 0 or block_size % kernel_block:
        raise ValueError(
            f"hsx: hidden-states cache view {tuple(shape)} does not match this vLLM release's layout "
            f"(block offsets on axis {block_axis}, {num_layers} captured layers, hidden {hidden_size}, "
            f"scheduler block size {block_size}); reading it would return wrong states"
        )


def slot_ids(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` cache slots of a request's blocks (CPU, int64)."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()
    if slots.numel() < num_tokens:
        raise ValueError(f"hsx: {len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    return slots[:num_tokens]


def gather(kv_cache: torch.Tensor, slots: torch.Tensor, block_axis: int, layer_index: list[int]) -> torch.Tensor:
    """[T, len(layer_index), hidden] for the given slots and captured-layer positions: one
    indexing kernel, only the requested layers read."""
    kernel_block = kv_cache.shape[block_axis]
    slots = slots.to(kv_cache.device, non_blocking=True)
    blk = (slots // kernel_block)[:, None]
    off = (slots % kernel_block)[:, None]
    layers = torch.tensor(layer_index, dtype=torch.long).to(kv_cache.device, non_blocking=True)[None, :]
    if block_axis == 2:
        return kv_cache[blk, layers, off]
    return kv_cache[blk, off, layers]
