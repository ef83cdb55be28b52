"""Beyond dense Llama: a tiny random mixture-of-experts and a tiny random hybrid
(Qwen3-Next: Gated DeltaNet layers + full attention), every layer id against
transformers in fp32, through a real `hsx serve` on vLLM's CPU backend."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from _reference import per_layer_rel_err, reference_states
from _server import ServerProcess
from conftest import need_vllm
from hsx.wire import decode

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FP32_TOL = 1e-4
NUM_LAYERS = 4
LAYERS = list(range(NUM_LAYERS + 1))  # every id; N = the pre-norm last layer


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from hsx.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", "qwen3_moe", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def moe_server(moe_model, log_dir):
    need_vllm()
    server = ServerProcess(str(moe_model), "--dtype", "float32", "--max-model-len", "1024",
                           "--layers", ",".join(map(str, LAYERS)), "--max-num-batched-tokens", "128",
                           log_dir=log_dir, name="moe")
    yield server.wait_ready()
    server.stop()


async def _exact_under_concurrency(server, model_dir, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(6, 1000) for _ in range(rng.choice([3, 30, 150, 400]))] for _ in range(16)]
    async with httpx.AsyncClient(timeout=300) as client:
        rs = await asyncio.gather(*[client.post(server.url + "/hidden_states", json={"input_ids": p})
                                    for p in prompts])
    worst = 0.0
    for p, r in zip(prompts, rs):
        assert r.status_code == 200, r.text
        dec = decode(r.content)
        assert dec.token_ids.tolist() == p and dec.layer_ids == LAYERS
        errs = per_layer_rel_err(dec.hidden_states, reference_states(str(model_dir), p, LAYERS))
        assert max(errs) < FP32_TOL, f"relative error per layer {dict(zip(LAYERS, errs))}"
        worst = max(worst, max(errs))
    return worst


async def test_tiny_moe_every_layer_matches_transformers(moe_server, moe_model):
    info = httpx.get(moe_server.url + "/info").json()
    assert info["architecture"] == "Qwen3MoeForCausalLM" and info["layer_ids"] == LAYERS
    worst = await _exact_under_concurrency(moe_server, moe_model, 0)
    print(f"\ntiny Qwen3-MoE (4 experts, 2 per token): 16 concurrent requests, worst relative error {worst:.2e}")
