#!/usr/bin/env python
"""`hsx regenerate --extract-to` in one pass against two passes, on one hsx serve:
`python bench/regen_one_pass.py [--model M] [--engine-args "..."] [--conversations N] [--out FILE]`.

Four runs, each on the same conversations opened by a system line of its own (so no run
reads another's cached pages), one engine alive at a time:
  0. `vllm serve` with the same engine flags, `hsx regenerate` against it, then the server is
     stopped and, once hsx serve is up, `hsx extract` of that output against hsx serve (what a
     corpus costs without hsx serve generating it);
then on one hsx serve:
  1. `hsx regenerate` alone (the baseline: what generating the corpus costs);
  2. `hsx regenerate --extract-to` in one pass (states read from the pages each generation wrote);
  3. the same with `--two-pass` (regenerate everything, then `hsx extract` of the output).
For each: wall seconds, corpus tokens/s (tokens stored in the corpus per second of the whole
command; run 0 counts both commands, not the server restart between them), and the engines'
own counters from /metrics (prompt tokens computed, prompt tokens served from the prefix
cache, generated tokens: vLLM's counters for vllm serve, hsx's for hsx serve), with the
ratios to run 1. The KV cache is
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
EXTRACT_ARGS = ["--format", "speculators", "--layers"]  # followed by the corpus layers
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


def vllm_engine_tokens(url: str) -> dict[str, float]:
    """vllm serve's own counters, named as engine_tokens names hsx serve's."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found = {"prompt_tokens": 0.0, "prompt_cached_tokens": 0.0, "generation_tokens": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("source") == "local_compute":
                found["prompt_tokens"] += s.value
            elif s.name == "vllm:prompt_tokens_cached_total":
                found["prompt_cached_tokens"] += s.value
            elif s.name == "vllm:generation_tokens_total":
                found["generation_tokens"] += s.value
    return found


def vllm_flags(engine_args: str) -> list[str]:
    """The engine flags without hsx serve's own (--layers)."""
    flags, out = shlex.split(engine_args), []
    skip = False
    for f in flags:
        if skip:
            skip = False
        elif f == "--layers":
            skip = True
        elif not f.startswith("--layers="):
            out.append(f)
    return out


def corpus_tokens(corpus: Path) -> int:
    lines = (corpus / "manifest.jsonl").read_text().splitlines() if (corpus / "manifest.jsonl").exists() else []
    return sum(int(json.loads(x).get("tokens", 0)) for x in lines)


def run(url: str, name: str, args: argparse.Namespace, tmp: Path, extract: bool = False, *extra: str,
        counters=engine_tokens, model: str | None = None) -> dict:
    inputs = conversations(name, args.conversations, args.prompt_chars, tmp / f"{name}.in.jsonl")
    corpus = tmp / f"{name}.corpus"
    argv = [*HSX, "regenerate", "--server", url, "--input", str(inputs), "--output", str(tmp / f"{name}.jsonl"),
            "--max-tokens", str(args.max_tokens), "--concurrency-per-server", str(args.concurrency), "--quiet"]
    if model:
        argv += ["--model", model]
    if extract:
        argv += ["--extract-to", str(corpus), *extra, "--", *EXTRACT_ARGS, args.layers, "--quiet"]
    return timed(name, argv, url, counters, corpus if extract else None)


def extract(url: str, name: str, args: argparse.Namespace, tmp: Path) -> dict:
    """`hsx extract` of run `name`'s regenerated output against hsx serve, as --two-pass does it."""
    corpus = tmp / f"{name}.corpus"
    argv = [*HSX, "extract", "--server", url, "--input", str(tmp / f"{name}.jsonl"), "--output", str(corpus),
            "--concurrency-per-server", str(args.concurrency), *EXTRACT_ARGS, args.layers, "--quiet"]
    return timed(f"{name} extract", argv, url, engine_tokens, corpus)


def added(a: dict, b: dict) -> dict:
    """Two commands as one run: walls, corpus and counters summed."""
    wall, tokens = a["wall_s"] + b["wall_s"], a["corpus_tokens"] + b["corpus_tokens"]
    return {"wall_s": wall, "corpus_tokens": tokens, "corpus_tokens_per_s": tokens / wall if tokens else None,
            "engine": {k: a["engine"][k] + b["engine"][k] for k in a["engine"]},
            "route": "vllm serve regenerates, hsx serve extracts", "parts": {"regenerate": a, "extract": b}}


def timed(name: str, argv: list[str], url: str, counters, corpus: Path | None) -> dict:
    before = counters(url)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{name}: exit {r.returncode}: {r.stderr[-2000:]}")
    after = counters(url)
    tokens = corpus_tokens(corpus) if corpus else 0
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
        vllm_regenerated = vllm_run(args, tmp)
        port = free_port()
        server = Server([*HSX, "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
                         *shlex.split(args.engine_args)], port, tmp / "serve.log")
        try:
            server.wait("/ready", args.timeout)
            run(server.url, "warmup", argparse.Namespace(**{**vars(args), "conversations": 2}), tmp)
            results = {"vllm_serve_then_extract": added(vllm_regenerated, extract(server.url, "vllm", args, tmp)),
                       "regenerate_alone": run(server.url, "alone", args, tmp),
                       "one_pass": run(server.url, "one", args, tmp, True),
                       "two_pass": run(server.url, "two", args, tmp, True, "--two-pass")}
        finally:
            server.stop()
    return report(results, args)


def vllm_run(args: argparse.Namespace, tmp: Path) -> dict:
    """Run 0's first half: regenerate against vllm serve (then stopped: one engine at a time)."""
    port = free_port()
    # vLLM's OpenAI server module: the `vllm` script needs the package's metadata (absent from
    # some CPU builds)
    server = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                     "--host", "127.0.0.1", "--port", str(port), *vllm_flags(args.engine_args)], port,
                    tmp / "vllm.log")
    try:
        server.wait("/health", args.timeout)
        warm = argparse.Namespace(**{**vars(args), "conversations": 2})
        run(server.url, "vllm-warmup", warm, tmp, counters=vllm_engine_tokens, model=args.model)
        return run(server.url, "vllm", args, tmp, counters=vllm_engine_tokens, model=args.model)
    finally:
        server.stop()


def report(results: dict, args: argparse.Namespace) -> int:
    base = results["regenerate_alone"]["engine"]["prompt_tokens"] or 1.0
    print(f"{'run':<24}{'wall s':>9}{'corpus tok':>12}{'corpus tok/s':>14}{'prompt computed':>17}"
          f"{'x alone':>9}{'prompt cached':>15}{'generated':>11}")
    for name, r in results.items():
        e = r["engine"]
        rate = f"{r['corpus_tokens_per_s']:.0f}" if r["corpus_tokens_per_s"] else "-"
        print(f"{name:<24}{r['wall_s']:>9.1f}{r['corpus_tokens']:>12}{rate:>14}{e['prompt_tokens']:>17.0f}"
              f"{e['prompt_tokens'] / base:>9.2f}{e['prompt_cached_tokens']:>15.0f}{e['generation_tokens']:>11.0f}")
    one = results["one_pass"]["corpus_tokens_per_s"]
    for other in ("two_pass", "vllm_serve_then_extract"):
        rate = results[other]["corpus_tokens_per_s"]
        if one and rate:
            print(f"one pass / {other}, corpus tokens/s: {one / rate:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results},
                                       indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
