#!/usr/bin/env python
"""`hsx regenerate --extract-to` in one pass against two passes, on one hsx serve:
`python bench/regen_one_pass.py [--model M] [--engine-args "..."] [--conversations N] [--out FILE]`.

One server, three runs one after the other, each on the same conversations opened by a
system line of its own (so no run reads another's cached pages):
  1. `hsx regenerate` alone (the baseline: what generating the corpus costs);
  2. `hsx regenerate --extract-to` in one pass (states read from the pages each generation wrote);
  3. the same with `--two-pass` (regenerate everything, then `hsx extract` of the output).
For each: wall seconds, corpus tokens/s (tokens stored in the corpus per second of the whole
command), generated tokens/s (the regenerated turns' tokens per second of the command), and
the engine's own counters from /metrics (prompt tokens computed, prompt tokens served from
the prefix cache, generated tokens), with the ratios to run 1. The KV cache is kept smaller
than the run (`--num-gpu-blocks-override`) so pages age out as on a real corpus.
`--vllm-arm` first runs the same client on plain `vllm serve` (same `--engine-args`; hsx
serve's own flags go in `--hsx-args`): `hsx regenerate` there (its generated tokens/s against
run 1's is hsx serve's generation cost), then `hsx extract` of that output on the hsx serve
(the deployment that keeps vLLM for generation): its corpus tokens/s counts both commands.
Defaults are CPU-sized (stories260K fp32, 2-core box); `--out` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from regen_throughput import SHARED, THREADS, Server, free_port  # noqa: E402

HSX = [sys.executable, "-m", "hsx_tools.cli"]
DEFAULT_ENGINE = ("--dtype float32 --layers 0,1,2,3,4,5 --enable-prefix-caching --block-size 32 "
                  "--num-gpu-blocks-override 160 --max-num-seqs 4 --enforce-eager "
                  f"--chat-template {SHARED / 'chat_templates' / 'llama3.jinja'}")


def conversations(tag: str, n: int, chars: int, path: Path, source: Path = THREADS) -> Path:
    texts: list[str] = []
    for line in source.read_text().splitlines():
        msgs = [m["content"] for m in json.loads(line)["messages"] if m["role"] != "system"]
        text = " ".join(reversed(msgs))[:chars]
        if text not in texts and len(texts) < n:
            texts.append(text)
    rows = [{"messages": [{"role": "system", "content": f"Run {tag}."}, {"role": "user", "content": t}]}
            for t in texts]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def engine_tokens(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("hsx_engine_") and "_total" in line}
    return {k: values.get(f"hsx_engine_{k}_total", 0.0)
            for k in ("prompt_tokens", "prompt_cached_tokens", "generation_tokens")}


def corpus_tokens(corpus: Path) -> int:
    lines = (corpus / "manifest.jsonl").read_text().splitlines() if (corpus / "manifest.jsonl").exists() else []
    return sum(int(json.loads(x).get("tokens", 0)) for x in lines)


def generated_tokens(output: Path) -> int:
    """The regenerated turns' token ids in an `hsx regenerate` output."""
    if not output.exists():
        return 0
    return sum(len(t.get("token_ids") or []) for line in output.read_text().splitlines() if line.strip()
               for t in json.loads(line).get("hsx_turns", []))


def extract(url: str, name: str, args: argparse.Namespace, tmp: Path, source: Path) -> dict:
    """`hsx extract` of a regenerated output on `url`: the second pass of the vLLM-serve deployment."""
    corpus = tmp / f"{name}.corpus"
    argv = [*HSX, "extract", "--server", url, "--input", str(source), "--output", str(corpus), "--format",
            "speculators", "--layers", args.layers, "--concurrency-per-server", str(args.concurrency), "--quiet"]
    before = engine_tokens(url)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{name}: exit {r.returncode}: {r.stderr[-2000:]}")
    after = engine_tokens(url)
    return {"wall_s": wall, "corpus_tokens": corpus_tokens(corpus), "engine": {k: after[k] - before[k] for k in after}}


def run(url: str, name: str, args: argparse.Namespace, tmp: Path, extract: bool = False, *extra: str) -> dict:
    inputs = conversations(name, args.conversations, args.prompt_chars, tmp / f"{name}.in.jsonl", args.input)
    corpus = tmp / f"{name}.corpus"
    argv = [*HSX, "regenerate", "--server", url, "--input", str(inputs), "--output", str(tmp / f"{name}.jsonl"),
            "--max-tokens", str(args.max_tokens), "--concurrency-per-server", str(args.concurrency), "--quiet"]
    if args.no_metrics:  # vllm serve: the model's name as it serves it
        argv += ["--model", args.model]
    if extract:
        argv += ["--extract-to", str(corpus), *extra, "--", "--format", "speculators", "--layers", args.layers,
                 "--quiet"]
    before = engine_tokens(url) if "/metrics" not in args.no_metrics else {}
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{name}: exit {r.returncode}: {r.stderr[-2000:]}")
    after = engine_tokens(url) if "/metrics" not in args.no_metrics else {}
    tokens = corpus_tokens(corpus) if extract else 0
    generated = generated_tokens(tmp / f"{name}.jsonl")
    route = next((line for line in r.stderr.splitlines() if ": one pass:" in line or ": two passes:" in line), "")
    return {"wall_s": wall, "corpus_tokens": tokens, "corpus_tokens_per_s": tokens / wall if tokens else None,
            "generated_tokens": generated, "generated_tokens_per_s": generated / wall,
            "engine": {k: after[k] - before.get(k, 0.0) for k in after}, "route": route}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(SHARED / "models" / "stories260K"))
    p.add_argument("--engine-args", default=DEFAULT_ENGINE)
    p.add_argument("--layers", default="1,2,3,5", help="corpus layers (speculators EAGLE-3: 3 aux + the last)")
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--prompt-chars", type=int, default=520)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900, help="seconds the server may take to start")
    p.add_argument("--input", type=Path, default=THREADS, help="chats whose turns make the conversations")
    p.add_argument("--hsx-args", default="", help="hsx serve flags beside --engine-args (not given to vllm serve)")
    p.add_argument("--vllm-arm", action="store_true",
                   help="also: hsx regenerate on vllm serve (same --engine-args), then hsx extract of it on hsx serve")
    p.add_argument("--warmup", type=int, default=2, help="conversations of each server's warm-up run")
    p.add_argument("--keep-logs", type=Path, help="copy the servers' logs into this directory")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.no_metrics = ""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="hsx-one-pass-") as d:
        tmp = Path(d)
        warm = argparse.Namespace(**{**vars(args), "conversations": args.warmup})
        try:
            if args.vllm_arm:
                port = free_port()
                # vLLM's OpenAI server module, as bench/regen_throughput.py starts it
                vllm = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                               "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.engine_args)], port,
                              tmp / "vllm.log")
                plain = argparse.Namespace(**{**vars(args), "no_metrics": "/metrics"})  # vllm serve: no hsx counters
                try:
                    vllm.wait("/health", args.timeout)
                    run(vllm.url, "vwarmup", argparse.Namespace(**{**vars(warm), "no_metrics": "/metrics"}), tmp)
                    results["vllm_regenerate"] = run(vllm.url, "vllm", plain, tmp)
                    save_partial(results, args)
                finally:
                    vllm.stop()
            port = free_port()
            server = Server([*HSX, "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
                             *shlex.split(args.engine_args), *shlex.split(args.hsx_args)], port, tmp / "serve.log")
            try:
                server.wait("/ready", args.timeout)
                run(server.url, "warmup", warm, tmp)
                for key, name, more in (("regenerate_alone", "alone", ()), ("one_pass", "one", (True,)),
                                        ("two_pass", "two", (True, "--two-pass"))):
                    results[key] = run(server.url, name, args, tmp, *more)
                    save_partial(results, args)
                if args.vllm_arm:
                    results["vllm_then_extract"] = vllm_then_extract(
                        results["vllm_regenerate"], extract(server.url, "vllm", args, tmp, tmp / "vllm.jsonl"))
            finally:
                server.stop()
        finally:
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for log in tmp.glob("*.log"):
                    (args.keep_logs / f"one-pass-{log.name}").write_bytes(log.read_bytes())
    return report(results, args)


def save_partial(results: dict, args: argparse.Namespace) -> None:
    """The runs so far, should a later one not finish (the final report overwrites it)."""
    if args.out:
        args.out.write_text(json.dumps({"partial": True, "settings": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=1, default=str) + "\n")


def vllm_then_extract(regen: dict, ext: dict) -> dict:
    """`hsx regenerate` on vllm serve, then `hsx extract` of its output on hsx serve: one figure."""
    wall = regen["wall_s"] + ext["wall_s"]
    return {"wall_s": wall, "regenerate_wall_s": regen["wall_s"], "extract_wall_s": ext["wall_s"],
            "corpus_tokens": ext["corpus_tokens"],
            "corpus_tokens_per_s": ext["corpus_tokens"] / wall if ext["corpus_tokens"] else None,
            "generated_tokens": regen["generated_tokens"], "generated_tokens_per_s": regen["generated_tokens_per_s"],
            "engine": ext["engine"], "route": "vllm serve, then hsx extract on hsx serve"}


def report(results: dict, args: argparse.Namespace) -> int:
    base = results["regenerate_alone"]["engine"]["prompt_tokens"] or 1.0
    print(f"{'run':<19}{'wall s':>9}{'corpus tok':>12}{'corpus tok/s':>14}{'gen tok/s':>11}{'prompt computed':>17}"
          f"{'x alone':>9}{'prompt cached':>15}{'generated':>11}")
    for name, r in results.items():
        e = r["engine"]
        rate = f"{r['corpus_tokens_per_s']:.0f}" if r["corpus_tokens_per_s"] else "-"
        gen = f"{r['generated_tokens_per_s']:.0f}" if r.get("generated_tokens_per_s") else "-"
        counters = (f"{e['prompt_tokens']:>17.0f}{e['prompt_tokens'] / base:>9.2f}{e['prompt_cached_tokens']:>15.0f}"
                    f"{e['generation_tokens']:>11.0f}") if e else f"{'(vllm serve)':>17}"
        print(f"{name:<19}{r['wall_s']:>9.1f}{r['corpus_tokens']:>12}{rate:>14}{gen:>11}{counters}")
    one, two = results["one_pass"], results["two_pass"]
    if one["corpus_tokens_per_s"] and two["corpus_tokens_per_s"]:
        print(f"one pass / two passes, corpus tokens/s: {one['corpus_tokens_per_s'] / two['corpus_tokens_per_s']:.2f}x")
    ratios = {}
    if "vllm_then_extract" in results:
        ve = results["vllm_then_extract"]
        if ve["corpus_tokens_per_s"] and one["corpus_tokens_per_s"]:
            ratios["one_pass_over_vllm_then_extract"] = one["corpus_tokens_per_s"] / ve["corpus_tokens_per_s"]
            ratios["two_pass_over_vllm_then_extract"] = (two["corpus_tokens_per_s"] or 0) / ve["corpus_tokens_per_s"]
            print(f"one pass / (vllm serve + hsx extract), corpus tokens/s: "
                  f"{ratios['one_pass_over_vllm_then_extract']:.2f}x")
        v, h = results["vllm_regenerate"]["generated_tokens_per_s"], results["regenerate_alone"]["generated_tokens_per_s"]
        if v:
            ratios["generation_hsx_over_vllm"] = h / v
            print(f"generation, hsx serve / vllm serve (hsx regenerate alone on each): {h:,.0f} / {v:,.0f} tokens/s "
                  f"= {h / v:.3f}x (target >= 0.95)")
    if ratios:
        results["ratios"] = ratios
    if args.out:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results},
                                       indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
