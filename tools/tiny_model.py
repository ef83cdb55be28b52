"""Make a small random-weight model with a real tokenizer, offline (transformers + torch only).

Families: `llama` (dense; `hsx demo`, the tests and the benchmark, which asks for a
bigger one: 16 layers x 2048 hidden), `qwen3_moe` (a mixture of experts),
`qwen3_next` (a hybrid: Gated DeltaNet linear-attention layers, one full-attention
layer in four, MoE MLPs), `deepseek_v3` (the DeepSeek-V3 / Kimi-K2 architecture:
MLA attention, sigmoid `noaux_tc` routing over routed + 1 shared expert, first layer dense)
`kimi_k25` (Kimi-K2.5: that DeepSeek-V3 text model behind a one-block MoonViT vision
tower, in the multimodal checkpoint layout vLLM's `KimiK25ForConditionalGeneration` loads)
and `qwen2_5_vl` (Qwen2.5-VL: a small ViT with window attention and M-RoPE text; images
through its own processor, tiny_vlm.py).
The tokenizer is a byte-level BPE trained here on a short
built-in text, with a ChatML-style chat template that marks assistant turns with
`{% generation %}`, so every request kind works on it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] }}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TEXT = """
Speculative decoding lets a small draft model propose tokens that a large target model
verifies in one forward pass. EAGLE-3 drafts from the target's own hidden states taken at
a few layers, so training it needs those states for every token of a chat corpus. A
prefill computes them; the service returns them compressed over HTTP, and the client
writes a corpus that trainers read. Once upon a time a little girl named Lily found a
shiny red ball in the park. She asked her mother if she could keep it, and her mother
said yes. The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
User: What is the capital of France? Assistant: The capital of France is Paris.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation ! ? . , ; : ' " ( ) [ ] { } < > / \\ | - _ + = * & ^ % $ # @ ~
"""

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out: Path, vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)
    return fast


FAMILIES = ("llama", "qwen3_moe", "qwen3_next", "deepseek_v3", "kimi_k25", "qwen2_5_vl")

# Kimi-K2.5's media markers (special tokens of its tokenizer)
KIMI_MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]

# MLA head sizes of DeepSeek-V3 / Kimi-K2, which vLLM's MLA backends require: its CPU and
# Hopper kernels take a 576 = 512 + 64 latent and a 192 = 128 + 64 query-key head, and
# refuse others ("Head dimension 96 is not supported by MLA" for 32 + 32 + 32).
DEEPSEEK_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _config(family: str, tokenizer, *, num_layers: int, hidden_size: int, intermediate_size: int, num_heads: int,
            num_kv_heads: int, vocab_size: int, max_position_embeddings: int, mla: dict | None = None):
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    head_dim = hidden_size // num_heads
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig(**common), LlamaForCausalLM
    # 4 experts, 2 per token, small expert MLPs: every expert gets tokens in a short prompt.
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 2, norm_topk_prob=True)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeConfig(**common, **moe, head_dim=head_dim, decoder_sparse_step=1), Qwen3MoeForCausalLM
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
        # Every token goes to both of 2 experts: the hybrid runs in bf16 on vLLM's CPU backend,
        # where a top-k choice between near-tied experts flips for a few tokens, numerics that
        # would hide what this model is for (the GDN layers). qwen3_moe covers routing, in fp32.
        # (vLLM's Qwen3-Next needs MoE layers; dense MLPs everywhere fail to load.)
        moe.update(num_experts=2, num_experts_per_tok=2)
        cfg = Qwen3NextConfig(
            **common, **moe, head_dim=head_dim, layer_types=layer_types, decoder_sparse_step=1,
            shared_expert_intermediate_size=intermediate_size // 2, partial_rotary_factor=0.25,
            # 128 as in Qwen3-Next: vLLM's CPU Gated DeltaNet kernel takes no other head size.
            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=4,
        )
        return cfg, Qwen3NextForCausalLM
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        # Routing as in Kimi-K2 (one expert group, sigmoid scores plus a selection bias),
        # scaled down: 8 routed experts, 2 per token, 1 shared; the first layer dense.
        # MLA has no grouped KV heads (transformers needs them equal); eps 1e-6 as DeepSeek ships.
        common.update(num_key_value_heads=num_heads, rms_norm_eps=1e-6)
        cfg = DeepseekV3Config(
            **common, **(mla or DEEPSEEK_MLA), q_lora_rank=hidden_size // 2,
            moe_intermediate_size=intermediate_size // 2, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
        return cfg, DeepseekV3ForCausalLM
    if family == "kimi_k25":
        from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

        text, _ = _config("deepseek_v3", tokenizer, num_layers=num_layers, hidden_size=hidden_size,
                          intermediate_size=intermediate_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, mla=mla)
        # The smallest MoonViT: one block, 2 heads of 32; the projector's norm takes its width.
        vision = dict(patch_size=14, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_hidden_layers=1, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4)
        media = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id"),
                         tokenizer.convert_tokens_to_ids(["<|media_begin|>", "<|media_pad|>", "<|media_end|>"])))
        cfg = Kimi_K25Config(text_config=text.to_dict(), vision_config=vision, projection_hidden_size=64,
                             tie_word_embeddings=False, **media)
        return cfg, Kimi_K25ForConditionalGeneration
    if family == "qwen2_5_vl":
        from hsx_tools.tiny_vlm import qwen2_5_vl_config

        return qwen2_5_vl_config(common, tokenizer, head_dim)
    raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")


def make_tiny_model(
    out: str | os.PathLike,
    family: str = "llama",
    *,
    num_layers: int = 6,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    seed: int = 0,
    mla: dict | None = None,
    config_overrides: dict | None = None,
    weights: bool = True,
) -> Path:
    """Write a random model of `family` (head_dim = hidden/heads must be >= 32 for vLLM CPU).
    `mla` overrides deepseek_v3's MLA head sizes (DEEPSEEK_MLA), e.g. to provoke vLLM's refusal.
    `config_overrides` sets config fields after the family's defaults (e.g. n_routed_experts;
    a dotted key sets a sub-config's field, e.g. vision_config.depth).
    `weights=False` writes the config and tokenizer only, for vLLM's `--load-format dummy`: a
    model the size of a real one (a benchmark's shape) without writing its weights."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _family_tokenizer(out, family, vocab_size)
    config, model_cls = _config(
        family, tokenizer, num_layers=num_layers, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_heads=num_heads, num_kv_heads=num_kv_heads, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, mla=mla,
    )
    _override(config, family, config_overrides or {})
    if weights:
        _write_random_weights(out, family, config, model_cls, dtype, seed)
    else:
        config.architectures = [model_cls.__name__]  # save_pretrained of a model would write it
        config.save_pretrained(out)
    if family == "kimi_k25":
        if weights:
            _kimi_checkpoint_layout(out)
        _write_kimi_media_config(out)
    if family == "qwen2_5_vl":
        from hsx_tools.tiny_vlm import write_qwen_vl_processor

        write_qwen_vl_processor(out)
    _finish_config(out, family, dtype)
    return out


def _override(config: Any, family: str, overrides: dict) -> None:
    for key, value in overrides.items():
        target, _, field = key.rpartition(".")  # "vision_config.depth": a sub-config's field
        obj = getattr(config, target) if target else config
        if not hasattr(obj, field):
            raise ValueError(f"{family} config has no field {key!r}")
        setattr(obj, field, value)
    if family == "qwen2_5_vl" and "vision_config.fullatt_block_indexes" not in overrides:
        depth = config.vision_config.depth  # full attention every 8th block, as Qwen2.5-VL's 7 .. 31 of 32
        config.vision_config.fullatt_block_indexes = [i for i in range(depth) if i % 8 == 7] or [depth - 1]


def _family_tokenizer(out: Path, family: str, vocab_size: int):
    """The tiny tokenizer, with what a vision family's processor looks up in it."""
    tokenizer = make_tokenizer(out, vocab_size=min(vocab_size, 1024))
    if family == "kimi_k25":  # Kimi-K2.5's media markers, which vLLM's processor looks up by name
        from hsx_tools.tiny_vlm import KIMI_CHAT_TEMPLATE

        tokenizer.add_special_tokens({"additional_special_tokens": KIMI_MEDIA_TOKENS})
        tokenizer.chat_template = KIMI_CHAT_TEMPLATE  # renders image parts as Kimi's media markup
        tokenizer.save_pretrained(out)
    if family == "qwen2_5_vl":
        from hsx_tools.tiny_vlm import qwen_vl_tokenizer

        tokenizer = qwen_vl_tokenizer(tokenizer, out)
    return tokenizer


def _write_random_weights(out: Path, family: str, config, model_cls, dtype: str, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():
        # A non-trivial final norm, so post-norm checks mean something.
        getattr(model.model, "language_model", model.model).norm.weight.uniform_(0.5, 1.5)
        # Random init leaves some parameters at their defaults (e.g. GDN's A_log, dt_bias),
        # which would hide a layer that vLLM computes differently: perturb every 1-D one.
        if family == "qwen3_next":
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" not in name:
                    p.add_(torch.randn_like(p) * 0.1)
        # The routers' selection bias starts at zero, which would leave it unchecked.
        if family in ("deepseek_v3", "kimi_k25"):
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.add_(torch.randn_like(b) * 0.1)
    model.save_pretrained(out, safe_serialization=True)


# transformers' save of Kimi-K2.5 reverses its load-time renames only in part (its reverse of
# the vision tower's `blocks` -> `layers` renames the text layers too): the names Moonshot's
# checkpoints use, which vLLM loads and transformers reads back.
_KIMI_SAVED_NAMES = {
    "language_model.model.blocks.": "language_model.model.layers.",
    "model.mm_projector.": "mm_projector.",
    "vision_tower.encoder.patch_embed.": "vision_tower.patch_embed.",
}


def _write_kimi_media_config(out: Path) -> None:
    """The image preprocessing settings Kimi-K2.5 ships (`media_proc_cfg`), which vLLM's own
    Kimi-K2.5 image processor reads at start, even for text-only serving."""
    media = dict(patch_size=14, merge_kernel_size=2, temporal_merge_kernel_size=4, image_mean=[0.5] * 3,
                 image_std=[0.5] * 3, in_patch_limit=16384, in_patch_limit_each_frame=4096,
                 in_patch_limit_video=None, patch_limit_on_one_side=512, fixed_output_tokens=None)
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}, indent=2))


def _kimi_checkpoint_layout(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        renamed = {}
        for name, t in tensors.items():
            for old, new in _KIMI_SAVED_NAMES.items():
                if name.startswith(old):
                    name = new + name[len(old):]
            renamed[name] = t
        save_file(renamed, shard, metadata={"format": "pt"})


def _finish_config(out: Path, family: str, dtype: str) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    if family in ("deepseek_v3", "kimi_k25"):
        # Read by vLLM, absent from transformers' config (which always routes this way):
        # sigmoid scores with the e_score_correction_bias choosing experts, as DeepSeek-V3 and
        # Kimi-K2 ship. Without topk_method vLLM's loader has no place for the bias; without
        # scoring_func vLLM routes by softmax.
        (cfg.get("text_config") or cfg).update(topk_method="noaux_tc", scoring_func="sigmoid")
    if family == "kimi_k25":
        cfg["architectures"] = ["KimiK25ForConditionalGeneration"]  # Moonshot's (and vLLM's) name
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def make_tiny_llama(out: str | os.PathLike, **kwargs) -> Path:
    """A random Llama; see make_tiny_model for the arguments."""
    return make_tiny_model(out, "llama", **kwargs)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hsx make-tiny-model", description=__doc__)
    p.add_argument("out")
    p.add_argument("--family", default="llama", choices=FAMILIES, help="dense Llama, MoE, hybrid, DeepSeek-V3 MLA + MoE or Kimi-K2.5 (default llama)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    path = make_tiny_model(
        a.out, a.family, num_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_heads=a.heads, num_kv_heads=a.kv_heads, vocab_size=a.vocab, max_position_embeddings=a.max_len,
        dtype=a.dtype,
    )
    print(path)
    return 0
