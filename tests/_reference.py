"""transformers reference states: id k < N is output_hidden_states[k]; id N is the final
norm's input (pre-norm), taken with a forward hook."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    # A multimodal target (Kimi-K2.5): its text path, which hsx serves
    multimodal = hasattr(AutoConfig.from_pretrained(model_dir), "text_config")
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir).to(torch.float32)  # fp32 whatever was saved
    model.eval()
    return model


@torch.no_grad()
def reference_states(model_dir: str, token_ids, layer_ids) -> torch.Tensor:
    """[T, L, H] float32 for the given ids."""
    model = load(model_dir)
    n = model.config.get_text_config().num_hidden_layers
    captured = {}
    decoder = getattr(model.model, "language_model", model.model)
    handle = decoder.norm.register_forward_hook(lambda m, inp, out: captured.__setitem__("pre", inp[0]))
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


def check_responses(responses, prompts, model_dir, layer_ids, tol: float,
                    contribution_tol: float | None = None) -> tuple[float, float]:
    """Assert every /hidden_states response is 200, carries its prompt's ids and matches
    transformers per layer (and, with contribution_tol, per layer's own contribution).
    Returns the worst errors seen (per layer, per contribution)."""
    from hsx.wire import decode

    worst = worst_c = 0.0
    for p, r in zip(prompts, responses, strict=True):
        assert r.status_code == 200, r.text
        dec = decode(r.content)
        assert dec.token_ids.tolist() == list(p) and dec.layer_ids == list(layer_ids)
        ref = reference_states(str(model_dir), p, layer_ids)
        errs = per_layer_rel_err(dec.hidden_states, ref)
        assert max(errs) < tol, f"relative error per layer {dict(zip(layer_ids, errs))}"
        worst = max(worst, *errs)
        if contribution_tol is not None:
            contrib = contribution_rel_err(dec.hidden_states.float(), ref)
            assert max(contrib) < contribution_tol, f"relative error of each layer's contribution {contrib}"
            worst_c = max(worst_c, *contrib)
    return worst, worst_c
