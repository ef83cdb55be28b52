"""Kimi-K2.5, the architecture hsx was made for: vLLM serves it as
`KimiK25ForConditionalGeneration`, a DeepSeek-V3 text model (MLA + MoE) behind a MoonViT
vision tower. A tiny random one (`make-tiny-model --family kimi_k25`, Moonshot's checkpoint
layout) through a real `hsx serve` on vLLM's CPU backend, text-only: every layer id 1..N
against transformers' Kimi-K2.5 text path, and its chat template through /tokenize."""

from __future__ import annotations

import asyncio
import importlib.util
import random

import httpx
import pytest

from _reference import check_responses
from _server import ServerProcess
from conftest import need_cpu_mla, need_vllm, ready_or_skip_fp32_mla, skip_if_fp32_mla_refused

pytestmark = pytest.mark.slow

NUM_LAYERS = 4
LAYERS = list(range(1, NUM_LAYERS + 1))  # id 0 is refused for this family (service/engine.py)
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory):
    from hsx_tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-kimi-k25", "kimi_k25", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def kimi_server(kimi_model, log_dir):
    need_cpu_mla()
    if importlib.util.find_spec("vllm.model_executor.models.kimi_k25") is None:
        pytest.skip("this vLLM has no Kimi-K2.5")
    skip_if_fp32_mla_refused()
    server = ServerProcess(str(kimi_model), "--dtype", "float32", "--max-model-len", "1024",
                           "--layers", ",".join(map(str, LAYERS)), log_dir=log_dir, name="kimi-k25")
    yield ready_or_skip_fp32_mla(server)
    server.stop()


@pytest.mark.engine
async def test_tiny_kimi_k25_text_path_every_layer_matches_transformers(kimi_server, kimi_model):
    info = httpx.get(kimi_server.url + "/info").json()
    assert info["architecture"] == "KimiK25ForConditionalGeneration" and info["layer_ids"] == LAYERS
    assert info["num_hidden_layers"] == NUM_LAYERS
    assert info["final_norm"]["tensor"] == "language_model.model.norm.weight"
    rng = random.Random(3)
    # ids below the media markers (<|media_begin|> ... at 600+): text-only prompts
    prompts = [[1] + [rng.randrange(6, 600) for _ in range(rng.choice([3, 30, 150, 400]))] for _ in range(12)]
    async with httpx.AsyncClient(timeout=300) as client:
        rs = await asyncio.gather(*[client.post(kimi_server.url + "/hidden_states", json={"input_ids": p})
                                    for p in prompts])
    worst, worst_delta = check_responses(rs, prompts, kimi_model, LAYERS, FP32_TOL, FP32_TOL)
    print(f"\ntiny Kimi-K2.5 (text path, MLA + MoE, fp32): 12 concurrent requests, worst relative error "
          f"{worst:.2e}, of a layer's contribution {worst_delta:.2e}")


@pytest.mark.engine
def test_tiny_kimi_k25_chat_goes_through_its_tokenizer(kimi_server):
    """hsx renders chats with the tokenizer's template (not the multimodal processor)."""
    chat = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Paris."}]
    r = httpx.post(kimi_server.url + "/tokenize", json={"messages": chat}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["loss_mask_source"] == "chat_template" and 0 < sum(body["loss_mask"]) < len(body["token_ids"])
    # Issue 36.0: a list of text parts was refused ("can only concatenate str (not "list") to str")
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in chat]
    r = httpx.post(kimi_server.url + "/tokenize", json={"messages": parts}, timeout=60)
    assert r.status_code == 200 and r.json()["token_ids"] == body["token_ids"], r.text


def test_tiny_kimi_k25_checkpoint_has_moonshots_names(tmp_path):
    """transformers' save reverses its Kimi-K2.5 renames only in part (text layers come out as
    `language_model.model.blocks.N`, which vLLM cannot load): the maker writes the names
    Moonshot's checkpoints use, and transformers reads them back whole."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from hsx_tools.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "kimi", "kimi_k25", num_layers=2, hidden_size=64, num_heads=2)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    prefixes = {n.split(".")[0] for n in names}
    assert prefixes == {"language_model", "vision_tower", "mm_projector"}, prefixes
    assert "language_model.model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert {"vision_tower.patch_embed.proj.weight", "mm_projector.pre_norm.weight"} <= names
    assert not [n for n in names if n.startswith("language_model.model.blocks.")]
    _, loading = AutoModelForImageTextToText.from_pretrained(str(model_dir), output_loading_info=True)
    assert not any(loading.values()), loading


def test_kimi_k25_layer_zero_refused_by_its_vllm_module():
    """vLLM's Kimi-K2.5 runs its DeepSeek text model, which dies on id 0: hsx's refusal must
    know the module vLLM's registry maps the architecture to (run: refused at start, ~20 s)."""
    need_vllm()
    from vllm.model_executor.models.registry import _VLLM_MODELS

    from hsx_service.engine.config import check_layer_zero
    from hsx_service.core.errors import StartupError

    module, cls_name = _VLLM_MODELS["KimiK25ForConditionalGeneration"]
    model_cls = type(cls_name, (), {"__module__": f"vllm.model_executor.models.{module}"})
    with pytest.raises(StartupError, match="id 0 .* cannot be captured from KimiK25ForConditionalGeneration"):
        check_layer_zero(model_cls, "KimiK25ForConditionalGeneration", [0, 4])
    check_layer_zero(model_cls, "KimiK25ForConditionalGeneration", [1, 4])
