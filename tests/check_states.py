"""Compare a running `hsx serve` with transformers, layer by layer, on any host.

For a model no test covers yet (e.g. the tiny hybrid on a GPU host):

    hsx make-tiny-model /tmp/tiny-qwen3-next --family qwen3_next --layers 4
    hsx serve /tmp/tiny-qwen3-next --dtype bfloat16 --layers 0,1,2,3,4 --allow-unverified-hybrid --port 8011 &
    python tests/check_states.py http://127.0.0.1:8011 /tmp/tiny-qwen3-next

Sends concurrent random prompts, compares every returned layer and, for consecutive ids,
each layer's own contribution with transformers in fp32. Needs transformers, torch, httpx.
Prints PASS/FAIL lines; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _reference import check_responses  # noqa: E402


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("model_dir")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tol", type=float, default=3e-2, help="per-layer relative error (bf16: 3e-2, fp32: 1e-4)")
    p.add_argument("--contribution-tol", type=float, default=5e-2)
    a = p.parse_args(argv)
    async with httpx.AsyncClient(timeout=600) as client:
        info = (await client.get(a.url + "/info")).json()
        vocab = info["vocab_size"]
        rng = random.Random(0)
        prompts = [[1] + [rng.randrange(6, vocab) for _ in range(rng.choice([3, 30, 150, 400]))]
                   for _ in range(a.requests)]
        rs = await asyncio.gather(*[client.post(a.url + "/hidden_states", json={"input_ids": q}) for q in prompts])
    ids = info["layer_ids"]
    consecutive = len(ids) > 1 and all(b == x + 1 for x, b in zip(ids, ids[1:]))
    try:
        worst, worst_c = check_responses(rs, prompts, a.model_dir, ids, a.tol,
                                         a.contribution_tol if consecutive else None)
    except AssertionError as exc:
        print(f"FAIL {info['architecture']} on vLLM {info['vllm_version']}: {str(exc)[:500]}")
        return 1
    print(f"PASS {info['architecture']} on vLLM {info['vllm_version']}, layers {info['layer_ids']}, "
          f"{info['dtype']}: worst per-layer rel err {worst:.2e} (tol {a.tol:g}), of a layer's contribution "
          f"{worst_c:.2e} (tol {a.contribution_tol:g})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
