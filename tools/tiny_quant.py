"""Quantize a small HF checkpoint into the formats hsx's users serve, plus its dequantized twin.

`hsx quantize-tiny-model SRC DST --scheme fp8-block|w4a16` reads SRC's safetensors (e.g. a
model from `hsx make-tiny-model`) and writes two checkpoints:

- DST, quantized. Only the linear weights of the decoder layers are quantized; embeddings,
  lm_head, norms and router gates (`mlp.gate`, `*_gate`) stay unquantized, as in real
  checkpoints (`--ignore REGEX` leaves more out, e.g. Kimi-K2's attention).
  - `fp8-block`: DeepSeek-V3's own format: float8_e4m3fn weights, a float32
    `weight_scale_inv` per 128 x 128 block ([ceil(out/128), ceil(in/128)], the factor the
    FP8 values are multiplied by), config `quant_method: fp8` with `weight_block_size`.
  - `w4a16`: compressed-tensors `pack-quantized` symmetric int4 (group size 128, or one
    scale per output channel where an in-dimension does not divide by 128), written by
    the compressed-tensors library's own compressor and config classes: the layout
    vLLM's CompressedTensors loader (Marlin / Machete kernels) reads.
- DST-dequant (or `--dequantized-out`): the same model with every quantized weight replaced
  by the value it dequantizes to, in float32: the transformers reference for the quantized
  model, so that a comparison sees only the quantized kernels' arithmetic. FP8: fp8 x
  fp32 scale in float32 (as DeepSeek's dequantizer and vLLM's block kernels, which scale
  the fp32 accumulator). W4A16: int4 x scale rounded once to the scale's dtype (bf16), as
  compressed-tensors' decompressor and the Marlin / Machete kernels compute it.

The unquantized tensors are written in `--dtype` (bfloat16, the activation dtype of the
quantized kernels) in DST and as the same values in float32 in the twin.

Dimensions: vLLM's block-FP8 linear layers need every output shard (q, k, v, gate, up) to
divide by 128, and Marlin's W4A16 kernels need in-features divisible by 128 (the group) and
out-features by 64; `QUANT_DIMS` is a tiny shape that meets both (`make_source`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

SCHEMES = ("fp8-block", "w4a16")
FP8_BLOCK = (128, 128)
W4_GROUP = 128
# hidden 256 with 4 heads of 64 and 2 KV heads: q 256, k and v 128, MLP 512; every shard
# divides by 128 (block FP8) and every in-dimension by 128 (int4 groups).
QUANT_DIMS = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
# Module names that real checkpoints leave unquantized inside the layers. Anchored with `$`:
# vLLM and compressed-tensors match `re:` patterns with re.match (start only), so an
# unanchored `.*\.gate` would also leave out every `gate_proj`.
ALWAYS_SKIPPED = (r".*norm$", r".*\.gate$", r".*_gate$")
_LAYER = re.compile(r"(.*\.)?layers\.\d+\.")


def make_source(out, family: str = "llama", *, num_layers: int = 4, **kwargs) -> Path:
    """A random model from hsx_tools.tiny_model with QUANT_DIMS (kwargs override them, and
    make_tiny_model's other arguments, e.g. dtype, pass through)."""
    from hsx_tools.tiny_model import make_tiny_model

    dims = {**QUANT_DIMS, **kwargs}
    if family == "deepseek_v3":
        # MLA has one K/V head per query head (DeepSeek-V3: 128 and 128); transformers'
        # attention repeats K/V by heads / kv_heads and breaks on anything else.
        dims["num_kv_heads"] = dims["num_heads"]
    return make_tiny_model(out, family, num_layers=num_layers, **dims)


def is_quantized(name: str, tensor, skipped: list[str]) -> bool:
    """A decoder layer's 2-D linear weight whose module name no `skipped` regex matches."""
    if not name.endswith(".weight") or tensor.dim() != 2 or not _LAYER.match(name):
        return False
    module = name[: -len(".weight")]
    # re.match, as vLLM and compressed-tensors read the config's `re:` patterns: a pattern
    # then leaves out the same modules here as there.
    return not any(re.match(p, module) for p in skipped)


def fp8_block_quantize(w, block=FP8_BLOCK):
    """(float8_e4m3fn weight, float32 weight_scale_inv [ceil(out/bo), ceil(in/bi)]): each block's
    largest magnitude maps to the format's largest finite value, 448."""
    import torch
    import torch.nn.functional as F

    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    rows, cols = w.shape
    bo, bi = block
    padded = F.pad(w.float(), (0, -cols % bi, 0, -rows % bo))
    blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), scale.contiguous()


def fp8_block_dequantize(q, scale_inv, block=FP8_BLOCK):
    """float32 weight = fp8 value x its block's scale_inv."""
    rows, cols = q.shape
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * full.float()


def w4a16_scheme(in_dims: list[int]):
    """Symmetric int4, group 128 if every in-dimension divides by it, else one scale per channel."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    grouped = all(d % W4_GROUP == 0 for d in in_dims)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group" if grouped else "channel",
                            group_size=W4_GROUP if grouped else None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def w4a16_quantize(w, scheme, scale_dtype):
    """(compressed per-module tensors: weight_packed, weight_scale, weight_shape; float32 dequantized
    weight), through compressed-tensors' own qparams, quantizer and pack-quantized compressor."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    w = w.float()
    # Per group (or per row): min / max over the group's in-features, as llm-compressor's
    # min-max observer does for weights.
    groups = w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group" else w.unsqueeze(1)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    # Stored in the activation dtype, as real W4A16 checkpoints are; the int values are
    # computed against the stored (rounded) scale so dequantization is exact.
    scale = scale.to(scale_dtype)
    zero_point = zero_point.to(torch.int8)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    compressed = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    # int x scale rounded once to the scale's dtype: what compressed-tensors' decompressor
    # yields and what Marlin / Machete compute (they scale in the activation dtype).
    ints = quantize(x=w, scale=scale, zero_point=zero_point, args=args, dtype=torch.int8)
    deq = (ints.float() * _per_column(scale.float(), w.shape[1])).to(scale_dtype).float()
    return compressed, deq


def _per_column(scale, cols: int):
    """[out, groups] scales repeated over each group's columns ([out, 1] broadcasts as is)."""
    return scale if scale.shape[1] == 1 else scale.repeat_interleave(cols // scale.shape[1], dim=1)


def _read_tensors(src: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"hsx quantize-tiny-model: no *.safetensors in {src}")
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)


def _write_config(dst: Path, dtype: str, quantization_config: dict | None) -> None:
    path = dst / "config.json"
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = dtype
    cfg.pop("dtype", None)
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    path.write_text(json.dumps(cfg, indent=2))


def quantize_checkpoint(src, dst, scheme: str, *, dequantized_out=None, ignore: tuple[str, ...] = (),
                        dtype: str = "bfloat16") -> tuple[Path, Path, dict]:
    """Write the quantized checkpoint and its float32 dequantized twin; return (dst, twin, summary)."""
    import torch
    from safetensors.torch import save_file

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    src, dst = Path(src), Path(dst)
    twin = Path(dequantized_out) if dequantized_out else dst.with_name(dst.name + "-dequant")
    if src.resolve() in (dst.resolve(), twin.resolve()):
        raise SystemExit("hsx quantize-tiny-model: the outputs must differ from SRC")
    store_dtype = getattr(torch, dtype)
    skipped = [*ALWAYS_SKIPPED, *ignore]
    tensors = _read_tensors(src)
    names = sorted(n for n, t in tensors.items() if is_quantized(n, t, skipped))
    if not names:
        raise SystemExit(f"hsx quantize-tiny-model: no decoder-layer linear weight to quantize in {src}")
    quant, deq = {}, {}
    if scheme == "w4a16":
        w4 = w4a16_scheme([tensors[n].shape[1] for n in names])
    for name, t in tensors.items():
        if name not in names:
            kept = t.to(store_dtype) if t.is_floating_point() else t
            quant[name] = kept
            deq[name] = kept.float() if t.is_floating_point() else t
            continue
        module = name[: -len(".weight")]
        if scheme == "fp8-block":
            q, scale_inv = fp8_block_quantize(t)
            quant[name], quant[module + ".weight_scale_inv"] = q, scale_inv
            deq[name] = fp8_block_dequantize(q, scale_inv)
        else:
            compressed, deq[name] = w4a16_quantize(t, w4, store_dtype)
            quant.update({f"{module}.{k}": v.contiguous() for k, v in compressed.items()})
    for out, tensors_out in ((dst, quant), (twin, deq)):
        _copy_side_files(src, out)
        save_file(tensors_out, str(out / "model.safetensors"), metadata={"format": "pt"})
    summary = {"scheme": scheme, "weights_quantized": len(names), "tensors_kept": len(tensors) - len(names)}
    if scheme == "fp8-block":
        # DeepSeek-V3's config.json, key for key (vLLM's Fp8Config.from_config reads them).
        qcfg = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(FP8_BLOCK)}
        # Linear layers left out by --ignore: vLLM's Fp8Config expects FP8 weights in every
        # linear layer not named here (exact module names).
        left_out = sorted(n[: -len(".weight")] for n, t in tensors.items()
                          if n not in names and is_quantized(n, t, list(ALWAYS_SKIPPED)))
        if left_out:
            qcfg["ignored_layers"] = left_out
        _write_config(dst, dtype, qcfg)
    else:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig

        # lm_head and the skipped modules by regex, as llm-compressor writes them (`re:` prefix).
        config = QuantizationConfig(config_groups={"group_0": w4}, format="pack-quantized",
                                    quantization_status="compressed",
                                    ignore=["lm_head", *(f"re:{p}" for p in skipped[1:])])
        _write_config(dst, dtype, None)
        ModelCompressor(quantization_config=config).update_config(str(dst))
        summary["strategy"] = w4.weights.strategy
    _write_config(twin, "float32", None)
    return dst, twin, summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hsx quantize-tiny-model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF checkpoint directory (safetensors), e.g. from `hsx make-tiny-model`")
    p.add_argument("dst", help="where the quantized checkpoint goes")
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--dequantized-out", help="where the float32 dequantized twin goes (default DST-dequant)")
    p.add_argument("--ignore", action="append", default=[],
                   help="regex (matched from the start of the module name, as vLLM does; end it with $ to "
                        "anchor) of more layers to leave unquantized, e.g. '.*self_attn\\.'")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="dtype of the unquantized tensors and the scales (default bfloat16)")
    a = p.parse_args(argv)
    dst, twin, summary = quantize_checkpoint(a.src, a.dst, a.scheme, dequantized_out=a.dequantized_out,
                                             ignore=tuple(a.ignore), dtype=a.dtype)
    print(json.dumps({"quantized": str(dst), "dequantized": str(twin), **summary}))
    return 0
