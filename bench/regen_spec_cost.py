#!/usr/bin/env python
"""What vLLM's `extract_hidden_states` speculative method costs plain generation, without hsx:
`python bench/regen_spec_cost.py --model M [--engine-args "..."] [--out FILE]`.

One offline vLLM engine (`vllm.LLM`) per arm, same prompts, greedy, same max_tokens:
  plain : no speculative config (what `vllm serve M` runs);
  spec  : the speculative config hsx serve sets (extract_hidden_states,
          num_speculative_tokens=1) with vLLM's stock hidden-states file connector
          (its CPU twin on CPU), i.e. vLLM's own extraction path, no hsx code on the
          generation path;
  nodraft: spec, with a scheduler that drops the method's decode-step drafts
          (hsx_tools.bench_nodraft_scheduler): what generation costs without verifying them;
  noconn, noconn_nodraft: the same two without the file connector (the method alone:
          the captured layers' outputs and its cache-only model's forward each step).
For each arm: generated tokens/s and vLLM's spec-decode counters (drafts, draft tokens,
accepted tokens), from which tokens scheduled per sequence per decode step follow. If the
spec arm is as slow as hsx serve's generation, the cost is vLLM's method, not hsx.
Each arm runs in its own process (the engine in-process), repeated --repeats times,
interleaved; besides wall-clock tokens/s it reports tokens per CPU second of that process,
which a shared machine's load disturbs far less.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ARMS = ("plain", "spec", "nodraft", "noconn", "noconn_nodraft")


def arm_main(spec: dict) -> None:
    from vllm import LLM, SamplingParams

    kw = json.loads(spec["engine_kwargs"])
    kw["model"] = spec["model"]
    kw["disable_log_stats"] = False  # the spec-decode counters
    if spec["arm"] != "plain":
        from hsx_tools.bench.engines import with_vllm_file_path

        kw = with_vllm_file_path(kw, [0], tempfile.mkdtemp(prefix="hsx-spec-cost-"))
    if spec["arm"] in ("noconn", "noconn_nodraft"):
        del kw["kv_transfer_config"]
    if spec["arm"] in ("nodraft", "noconn_nodraft"):
        kw["scheduler_cls"] = "hsx_tools.bench_nodraft_scheduler.NoDraftScheduler"
    llm = LLM(**kw)
    prompts = [f"Once upon a time there was a little {w}" for w in
               ("dog", "cat", "girl", "boy", "bird", "tree", "car", "fish")] * (spec["prompts"] // 8 + 1)
    prompts = prompts[: spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    before = _counters(llm)
    t, cpu = time.perf_counter(), _cpu_s()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t, _cpu_s() - cpu
    after = _counters(llm)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    result = {"arm": spec["arm"], "generated_tokens": generated,
              "token_ids_digest": hashlib.sha256(json.dumps([list(o.outputs[0].token_ids) for o in outs]).encode()
                                                 ).hexdigest()[:16], "elapsed_s": elapsed,
              "generated_tokens_per_s": generated / elapsed, "cpu_s": cpu,
              "generated_tokens_per_cpu_s": generated / cpu, "spec_decode": delta}
    if delta.get("num_drafts"):
        # per decode step a sequence runs 1 + draft tokens through the target; it keeps 1 + accepted
        result["target_tokens_per_seq_step"] = 1 + delta["num_draft_tokens"] / delta["num_drafts"]
        result["kept_tokens_per_seq_step"] = 1 + delta["num_accepted_tokens"] / delta["num_drafts"]
    print("RESULT " + json.dumps(result), flush=True)


def _cpu_s() -> float:
    """CPU seconds of this process, the engine included (it runs in-process): on a shared
    machine far steadier than wall time."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
            out[name] = out.get(name, 0) + m.value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--engine-args", default="{}", help="vllm.LLM keyword arguments as JSON")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)}")
    p.add_argument("--out", type=Path)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.arm:
        arm_main(json.loads(args.arm))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    runs: list[dict] = []
    for _ in range(args.repeats):
        for arm in arms:
            spec = {"arm": arm, "model": args.model, "engine_kwargs": args.engine_args, "prompts": args.prompts,
                    "max_tokens": args.max_tokens}
            r = subprocess.run([sys.executable, __file__, "--model", args.model, "--arm", json.dumps(spec)],
                               capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[1],
                               env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                raise RuntimeError(f"arm {arm} exited {r.returncode}: {r.stderr[-3000:]}")
            runs.append(json.loads(line[-1][7:]))
            print(shlex.join([arm]), json.dumps(runs[-1]), flush=True)
    best = {arm: max(r["generated_tokens_per_s"] for r in runs if r["arm"] == arm) for arm in arms}
    best_cpu = {arm: max(r["generated_tokens_per_cpu_s"] for r in runs if r["arm"] == arm) for arm in arms}
    summary = {"model": args.model, "engine_args": json.loads(args.engine_args), "prompts": args.prompts,
               "max_tokens": args.max_tokens, "runs": runs, "best_tokens_per_s": best,
               "ratio_to_plain": {arm: best[arm] / best["plain"] for arm in arms},
               "best_tokens_per_cpu_s": best_cpu,
               "cpu_ratio_to_plain": {arm: best_cpu[arm] / best_cpu["plain"] for arm in arms},
               "same_tokens_in_every_arm": len({r["token_ids_digest"] for r in runs}) == 1}
    print(json.dumps({k: summary[k] for k in ("best_tokens_per_s", "ratio_to_plain", "best_tokens_per_cpu_s",
                                              "cpu_ratio_to_plain", "same_tokens_in_every_arm")}))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
