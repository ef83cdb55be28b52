"""Reading captured hidden states out of the cache-only layer's KV pages (pure torch).

`extract_hidden_states` writes token t's states, all captured layers at once, into
slot `block_id * block_size + t % block_size` of one cache-only attention layer
whose "heads" are the captured layers and whose head size is the hidden size. The
per-layer view vLLM hands the connector is 4-D; where its block-offset axis sits
depends on the release (`vllm_compat.hidden_states_block_axis`):

    axis 1: [num_blocks, block_size, num_layers, hidden]   (vLLM < 0.29, "NHD")
    axis 2: [num_blocks, num_layers, block_size, hidden]   (vLLM >= 0.29, logical
            [B, H, N, C] whatever the physical layout, e.g. "LBNHC")

Slots must be numbered with the hidden-states group's own block size (its KV cache
spec), which is also the view's: for hybrid models vLLM bumps the global
`cache_config.block_size` (e.g. 528) while this group keeps a smaller one (e.g. 22),
and reading with the global one returns unwritten, all-zero slots (vLLM PR #46301).
`check_view` refuses to start when the two disagree.
"""

from __future__ import annotations

import torch


def check_view(shape: tuple[int, ...], block_axis: int, num_layers: int, hidden_size: int, block_size: int) -> None:
    """Raise ValueError (one line, with the reason) unless `shape` is the hidden-states view
    this release writes: the layers, the hidden size and the group's block size where expected."""
    if len(shape) != 4 or block_axis not in (1, 2):
        raise ValueError(f"hsx: hidden-states cache view {tuple(shape)} is not 4-D [blocks, ., ., hidden]")
    layers_axis = 3 - block_axis
    if shape[layers_axis] != num_layers or shape[3] != hidden_size or shape[block_axis] != block_size:
        raise ValueError(
            f"hsx: hidden-states cache view {tuple(shape)} does not match this vLLM release's layout "
            f"(block offsets on axis {block_axis}, {num_layers} captured layers, hidden {hidden_size}, "
            f"block size {block_size} of the hidden-states cache group); reading it would return wrong states"
        )


def slot_ids(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` cache slots of a request's blocks (CPU, int64)."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()
    if slots.numel() < num_tokens:
        raise ValueError(f"hsx: {len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    return slots[:num_tokens]


def gather(kv_cache: torch.Tensor, slots: torch.Tensor, block_axis: int, layer_positions: list[int]) -> torch.Tensor:
    """[T, len(layer_positions), hidden] for the given slots and captured-layer positions: one
    indexing kernel, only the requested layers read."""
    block = kv_cache.shape[block_axis]
    slots = slots.to(kv_cache.device, non_blocking=True)
    blk = (slots // block)[:, None]
    off = (slots % block)[:, None]
    layers = torch.tensor(layer_positions, dtype=torch.long).to(kv_cache.device, non_blocking=True)[None, :]
    if block_axis == 2:
        return kv_cache[blk, layers, off]
    return kv_cache[blk, off, layers]
