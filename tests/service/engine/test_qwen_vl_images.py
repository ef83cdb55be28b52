"""Issue 38: chats with images through a real `hsx serve` on a tiny Qwen2.5-VL in fp32
(`make-tiny-model --family qwen2_5_vl`; vLLM's Qwen2-VL family imports torchvision, which
hsx makes importable beside the CPU torch: hsx/compat.py). One server: a chat with one
image and one with three images of different sizes and formats, every layer id (0 included)
against transformers' Qwen2.5-VL fed the same image processor outputs and the same M-RoPE
positions (transformers computes them only when told which tokens are image tokens); the
same images through /v1/chat/completions."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import pytest
import torch

import _images as img
from _reference import per_layer_rel_err
from conftest import QWEN_VL_LAYERS as LAYERS, QWEN_VL_NUM_LAYERS as NUM_LAYERS

pytestmark = pytest.mark.slow

TOL = 1e-4  # fp32 on both sides


def _chat(urls: list[str]) -> list[dict]:
    return [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [*map(img.image_part, urls), {"type": "text", "text": "What is in them?"}]},
            {"role": "assistant", "content": "Colours and a gradient."}]


@torch.no_grad()
def _reference(model_dir: Path, ids: list[int], media: torch.Tensor, images: list[bytes]) -> torch.Tensor:
    """transformers' Qwen2.5-VL on the served ids, its image processor read from the model
    directory as vLLM reads it; mm_token_type_ids marks the image tokens so that transformers
    computes the 3-D (M-RoPE) positions, as vLLM does (without it: 1-D positions, ~1% off)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from _reference import load

    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    mm = AutoImageProcessor.from_pretrained(model_dir)(pil, return_tensors="pt")
    model = load(str(model_dir))
    captured = {}
    handle = model.model.language_model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("pre", i[0]))
    try:
        out = model(torch.as_tensor([ids]), pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
                    mm_token_type_ids=media[None].int(), output_hidden_states=True)
    finally:
        handle.remove()
    return torch.stack([captured["pre"][0] if k == NUM_LAYERS else out.hidden_states[k][0] for k in LAYERS], dim=1)


CASES = {
    "one image": [img.png(100, 80, (200, 30, 40))],
    "three images of different sizes": [img.png(60, 90, (20, 160, 60)), img.jpeg(200, 150), img.png(300, 40)],
}


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_image_chat_states_match_transformers_at_every_layer(qwen_vl_server, qwen_vl_model, case):
    from safetensors.torch import load as st_load

    images = CASES[case]
    chat = _chat([img.data_uri(b, "image/jpeg" if b[:2] == b"\xff\xd8" else "image/png") for b in images])
    r = httpx.post(qwen_vl_server.url + "/hidden_states", json={"messages": chat}, timeout=300,
                   headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200, r.text
    t = st_load(r.content)
    ids, media, loss = t["token_ids"].tolist(), t["media_mask"], t["loss_mask"]
    pad = json.loads((qwen_vl_model / "config.json").read_text())["image_token_id"]  # <|image_pad|>
    assert [i for i, m in zip(ids, media.tolist()) if m] == [pad] * int(media.sum())
    assert ids.count(pad) == int(media.sum()) >= 4 * len(images)
    assert not bool((media.bool() & loss.bool()).any()) and int(loss.sum()) > 0
    ref = _reference(qwen_vl_model, ids, media, images)
    errs = per_layer_rel_err(t["hidden_states"], ref)
    assert max(errs) < TOL, f"{case}: relative error per layer {dict(zip(LAYERS, errs))}"
    # The images are in the states: other images' reference is far off from the first image token on.
    other = _reference(qwen_vl_model, ids, media, [img.png(*_size(b), (5, 5, 250)) for b in images])
    first = int(media.nonzero()[0])
    off = max(per_layer_rel_err(t["hidden_states"][first:], other[first:]))
    assert off > 100 * TOL, f"another image's states are as close ({off:.2e})"
    print(f"\n{case}: {len(ids)} tokens, {int(media.sum())} image tokens, worst rel err {max(errs):.2e}")


def _size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(data)).size


@pytest.mark.engine
def test_chat_completion_with_images_takes_transformers_greedy_token(qwen_vl_server, qwen_vl_model):
    """/v1/chat/completions with the same image parts: the prompt ids are the expanded ones,
    the first greedy token is transformers' argmax on them and the same images, and a bad
    image is refused naming its part while the engine serves on."""
    from transformers import AutoImageProcessor

    from _reference import load

    images = [img.png(60, 90, (20, 160, 60)), img.jpeg(200, 150)]
    chat = [{"role": "user", "content": [*(img.image_part(img.data_uri(b)) for b in images),
                                         {"type": "text", "text": "What is in them?"}]}]
    r = httpx.post(qwen_vl_server.url + "/v1/chat/completions", timeout=300,
                   json={"messages": chat, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    ids, first = out["prompt_token_ids"], out["choices"][0]["token_ids"][0]
    pad = json.loads((qwen_vl_model / "config.json").read_text())["image_token_id"]
    media = torch.tensor([int(i == pad) for i in ids])
    assert out["usage"]["prompt_tokens"] == len(ids) and int(media.sum()) >= 4 * len(images)
    from PIL import Image

    mm = AutoImageProcessor.from_pretrained(qwen_vl_model)([Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                                                           return_tensors="pt")
    with torch.no_grad():
        logits = load(str(qwen_vl_model))(torch.as_tensor([ids]), pixel_values=mm["pixel_values"],
                                          image_grid_thw=mm["image_grid_thw"],
                                          mm_token_type_ids=media[None].int()).logits[0, -1]
    top2 = logits.topk(2)
    assert first == int(top2.indices[0]) or float(top2.values[0] - top2.values[1]) < 1e-4, (first, top2)
    bad = httpx.post(qwen_vl_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [img.image_part(img.data_uri(img.SVG, "image/svg+xml"))]}]})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("messages[0].content[0]: ")
    assert httpx.get(qwen_vl_server.url + "/health", timeout=10).status_code == 200
