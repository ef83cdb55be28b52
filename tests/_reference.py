"""transformers reference states: id k < N is output_hidden_states[k]; id N is the final
norm's input (pre-norm), taken with a forward hook."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(torch.float32)  # fp32 whatever was saved
    model.eval()
    return model


@torch.no_grad()
def reference_states(model_dir: str, token_ids, layer_ids) -> torch.Tensor:
    """[T, L, H] float32 for the given ids."""
    model = load(model_dir)
    n = model.config.num_hidden_layers
    captured = {}
    handle = model.model.norm.register_forward_hook(lambda m, inp, out: captured.__setitem__("pre", inp[0]))
    try:
        out = model(torch.as_tensor([list(token_ids)]), output_hidden_states=True)
    finally:
        handle.remove()
    per_layer = [captured["pre"][0] if k == n else out.hidden_states[k][0] for k in layer_ids]
    return torch.stack(per_layer, dim=1)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def per_layer_rel_err(got: torch.Tensor, ref: torch.Tensor) -> list[float]:
    return [rel_err(got[:, j], ref[:, j]) for j in range(ref.shape[1])]


def contribution_rel_err(got: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Relative error of each layer's own contribution (state j minus state j-1), for
    consecutive ids: a wrong or missing layer cannot hide behind the residual stream."""
    return [rel_err(got[:, j] - got[:, j - 1], ref[:, j] - ref[:, j - 1]) for j in range(1, ref.shape[1])]
