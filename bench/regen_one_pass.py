#!/usr/bin/env python
"""`hsx regenerate --extract-to` in one pass against two passes, on one hsx serve:
`python bench/regen_one_pass.py [--model M] [--engine-args "..."] [--conversations N] [--out FILE]`.

One server, three runs one after the other, each on the same conversations opened by a
system line of its own (so no run reads another's cached pages):
  1. `hsx regenerate` alone (the baseline: what generating the corpus costs);
  2. `hsx regenerate --extract-to` in one pass (states read from the pages each generation wrote);
  3. the same with `--two-pass` (regenerate everything, then `hsx extract` of the output).
For each: wall seconds, corpus tokens/s (tokens stored in the corpus per second of the whole
command), and the engine's own counters from /metrics (prompt tokens computed, prompt tokens
served from the prefix cache, generated tokens), with the ratios to run 1. The KV cache is
kept smaller than the run (`--num-gpu-blocks-override`) so pages age out as on a real corpus.
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


def conversations(tag: str, n: int, chars: int, path: Path) -> Path:
    texts: list[str] = []
    for line in THREADS.read_text().splitlines():
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


def run(url: str, name: str, args: argparse.Namespace, tmp: Path, extract: bool = False, *extra: str) -> dict:
    inputs = conversations(name, args.conversations, args.prompt_chars, tmp / f"{name}.in.jsonl")
    corpus = tmp / f"{name}.corpus"
    argv = [*HSX, "regenerate", "--server", url, "--input", str(inputs), "--output", str(tmp / f"{name}.jsonl"),
            "--max-tokens", str(args.max_tokens), "--concurrency-per-server", str(args.concurrency), "--quiet"]
    if extract:
        argv += ["--extract-to", str(corpus), *extra, "--", "--format", "speculators", "--layers", args.layers,
                 "--quiet"]
    before = engine_tokens(url)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{name}: exit {r.returncode}: {r.stderr[-2000:]}")
    after = engine_tokens(url)
    tokens = corpus_tokens(corpus) if extract else 0
    route = next((line for line in r.stderr.splitlines() if ": one pass:" in line or ": two passes:" in line), "")
    return {"wall_s": wall, "corpus_tokens": tokens, "corpus_tokens_per_s": tokens / wall if tokens else None,
            "engine": {k: after[k] - before[k] for k in after}, "route": route}


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
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="hsx-one-pass-") as d:
        tmp = Path(d)
        port = free_port()
        server = Server([*HSX, "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
                         *shlex.split(args.engine_args)], port, tmp / "serve.log")
        try:
            server.wait("/ready", args.timeout)
            run(server.url, "warmup", argparse.Namespace(**{**vars(args), "conversations": 2}), tmp)
            results = {"regenerate_alone": run(server.url, "alone", args, tmp),
                       "one_pass": run(server.url, "one", args, tmp, True),
                       "two_pass": run(server.url, "two", args, tmp, True, "--two-pass")}
        finally:
            server.stop()
    return report(results, args)


def report(results: dict, args: argparse.Namespace) -> int:
    base = results["regenerate_alone"]["engine"]["prompt_tokens"] or 1.0
    print(f"{'run':<18}{'wall s':>9}{'corpus tok':>12}{'corpus tok/s':>14}{'prompt computed':>17}"
          f"{'x alone':>9}{'prompt cached':>15}{'generated':>11}")
    for name, r in results.items():
        e = r["engine"]
        rate = f"{r['corpus_tokens_per_s']:.0f}" if r["corpus_tokens_per_s"] else "-"
        print(f"{name:<18}{r['wall_s']:>9.1f}{r['corpus_tokens']:>12}{rate:>14}{e['prompt_tokens']:>17.0f}"
              f"{e['prompt_tokens'] / base:>9.2f}{e['prompt_cached_tokens']:>15.0f}{e['generation_tokens']:>11.0f}")
    one, two = results["one_pass"], results["two_pass"]
    if one["corpus_tokens_per_s"] and two["corpus_tokens_per_s"]:
        print(f"one pass / two passes, corpus tokens/s: {one['corpus_tokens_per_s'] / two['corpus_tokens_per_s']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results},
                                       indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
