"""The tiny Qwen2.5-VL of `hsx make-tiny-model --family qwen2_5_vl`: the tiny text model's
sizes with M-RoPE, a two-block ViT (one windowed, one full-attention block, 2 heads of 32),
Qwen's media tokens in the tokenizer and a processor whose pixel budget keeps an image to
at most a few hundred tokens. vLLM 0.32 serves it as `Qwen2_5_VLForConditionalGeneration`.
"""

from __future__ import annotations

from pathlib import Path

QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2
MIN_PIXELS = (PATCH * MERGE) ** 2 * 4  # at least 4 image tokens
MAX_PIXELS = (PATCH * MERGE) ** 2 * 256  # at most 256 image tokens per image

def vl_chat_template(image: str, video: str | None = None) -> str:
    """Qwen2-VL's template shape (image and video parts in a content list, each rendered as
    the model's placeholder markup), assistant turns marked with {% generation %} as the tiny
    text models' template does."""
    video_branch = (f"{{% elif part['type'] == 'video' or 'video' in part %}}{{{{ '{video}' }}}}" if video else "")
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endif %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
        "{% else %}"
        "{% if message['content'] is string %}{{ message['content'] or '' }}{% elif message['content'] %}"
        "{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}}{{{{ '{image}' }}}}"
        f"{video_branch}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


CHAT_TEMPLATE = vl_chat_template("<|vision_start|><|image_pad|><|vision_end|>",
                                 "<|vision_start|><|video_pad|><|vision_end|>")
# Kimi-K2.5's image markup (its media markers around one <|media_pad|>, which vLLM expands)
KIMI_CHAT_TEMPLATE = vl_chat_template("<|media_begin|>image<|media_content|><|media_pad|><|media_end|>")


def qwen_vl_tokenizer(tokenizer, out: Path):
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def qwen2_5_vl_config(common: dict, tokenizer, head_dim: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {k: v for k, v in common.items() if k != "tie_word_embeddings"}
    half = head_dim // 2  # M-RoPE splits the rotary half over (time, height, width), as Qwen's 16/24/24 of 64
    spatial = (half - half // 4) // 2
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0,
                               "mrope_section": [half - 2 * spatial, spatial, spatial]}
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=common["hidden_size"],
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[1])
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_VL_TOKENS)))
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return cfg, Qwen2_5_VLForConditionalGeneration


def write_qwen_vl_processor(out: Path) -> None:
    """preprocessor_config.json, which vLLM's processor reads at start. The image processor
    only, written by its PIL version so that making the model needs no torchvision; loading
    takes transformers' default (torchvision) image processor where torchvision imports, and
    the two give the same pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    Qwen2VLImageProcessorPil(size=size, patch_size=PATCH, merge_size=MERGE).save_pretrained(out)
