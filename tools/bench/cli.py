"""`hsx bench` command line: presets, flags, and the run of the modes one after the other."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hsx.exit_codes import ExitCode
from hsx.sizes import fmt_bytes
from hsx_tools.bench.common import ensure_model, ensure_packages, hardware, log, make_prompts, model_facts, versions_light
from hsx_tools.bench.report import MODE_NAMES, format_table, ratios
from hsx.dtypes import by_name as dtype_by_name
from hsx.layers import default_layers

PRESETS: dict[str, dict[str, Any]] = {
    # CI on a 2-core box: a few minutes in all, three CPU engine starts included.
    "quick": {
        "make_model": "layers=4,hidden=128,ffn=256,heads=4,kv_heads=2,vocab=1024,dtype=bfloat16",
        "prompts": 32,
        "prompt_len": 256,
        "layers": "1,2,3,4",
        "concurrency": 8,
        "warmup": 4,
        # eager: torch.compile on a 2-core CPU costs ~1.5 min per engine start
        "engine_args": ["--max-num-batched-tokens", "2048", "--max-num-seqs", "64", "--enforce-eager"],
        "codec_sample": 0,
    },
    # The GPU target (one H200): random Llama 16 x 2048, bf16, 256 x 2048 tokens.
    "h200": {
        "make_model": "layers=16,hidden=2048,ffn=8192,heads=16,kv_heads=8,vocab=32000,dtype=bfloat16,max_pos=4096",
        "prompts": 256,
        "prompt_len": 2048,
        "layers": "2,8,13,16",
        "concurrency": 64,
        "warmup": 32,
        "engine_args": ["--max-num-batched-tokens", "16384", "--gpu-memory-utilization", "0.85"],
        "codec_sample": 8,
    },
}
DEFAULTS: dict[str, Any] = {
    "prompts": 64,
    "prompt_len": 512,
    "layers": None,
    "concurrency": 16,
    "warmup": 8,
    "codec_sample": 0,
}

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsx bench",
        description="Plain vLLM prefill (a) vs vLLM's file connector (b) vs hsx end to end (c), "
        "same model, prompts and engine flags; or, with --codec-only, the codec measurement.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  hsx bench --quick --out quick.json\n"
        "  hsx bench --h200 --out h200.json            # one H200, vLLM 0.26\n"
        "  hsx bench --model DIR --prompts 128 --prompt-len 1024 --layers 2,16,29,32 --engine-arg=--enforce-eager\n"
        "  hsx bench --codec-only\n  hsx bench --transport-only --body-mb 64 --requests 64 --concurrency 8",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory or hub id")
    src.add_argument("--make-model", metavar="SPEC",
                     help="build a random Llama: layers=16,hidden=2048,ffn=8192,heads=16,kv_heads=8,vocab=32000,dtype=bfloat16")
    pre = p.add_mutually_exclusive_group()
    pre.add_argument("--quick", action="store_const", dest="preset", const="quick",
                     help="CI preset: 4 x 128 random Llama, 32 prompts x 256 tokens, CPU friendly")
    pre.add_argument("--h200", action="store_const", dest="preset", const="h200",
                     help="the issue's GPU target: 16 x 2048 random Llama, 256 x 2048 tokens, layers 2,8,13,16")
    p.add_argument("--prompts", type=int, help="prompts measured per mode")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt")
    p.add_argument("--layers", help="layer ids, e.g. 2,8,13,16 (default [2, N//2, N-3, N])")
    p.add_argument("--concurrency", type=int, help="(c): requests in flight from the client")
    p.add_argument("--warmup", type=int, help="warm-up prompts per mode (not measured)")
    p.add_argument("--transfer", default="auto",
                   help="(c) client transfer, or several comma-separated, each timed on the same server "
                        "(the first is the headline): auto = shared-memory leases from this same-host "
                        "server, http = response bodies coded as --codec says, http:none / http:zstd / "
                        "http:bf16split = bodies with that coding [auto]")
    p.add_argument("--codec", default="zstd:1",
                   help="(c) response coding: zstd:LEVEL (server --zstd-level), bf16split (exponent planes, "
                        "zstd-1 frames) or none [zstd:1]")
    p.add_argument("--client-process", action="store_true",
                   help="(c): run the client in its own process tree (own session), over TCP to the server, "
                        "as a client on another host would be (loopback standing in for the network)")
    p.add_argument("--workers", type=int, default=1,
                   help="(c): hsx extract --workers N (the client's worker processes; with --client-process "
                        "they are children of the client's process tree) [1: the in-process loop]")
    p.add_argument("--max-buffer-bytes", type=int, metavar="BYTES",
                   help="(c): hsx extract --max-buffer-bytes, the client's memory budget (split among --workers) "
                        "[a quarter of the memory available]")
    p.add_argument("--dtype", default="bfloat16", help="engine --dtype for every mode [bfloat16]")
    p.add_argument("--max-model-len", type=int, help="engine --max-model-len [prompt length + 16]")
    p.add_argument("--enforce-eager", action="store_true", help="engine --enforce-eager (no torch.compile/graphs)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="a vLLM engine flag for every mode, repeatable (--engine-arg=--max-num-seqs=256)")
    p.add_argument("--engine-args", default="", metavar="STRING",
                   help="vLLM engine flags as one shell-quoted string, for every mode")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="an hsx serve flag for (c) only, repeatable (--server-arg=--arena-bytes=8589934592)")
    p.add_argument("--modes", default="a,b,c", help="which modes, in order [a,b,c]")
    p.add_argument("--seed", type=int, default=0, help="prompt seed [0]")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--workdir", help="models, prompts, logs, corpus (default: a new temp dir, removed unless --keep)")
    p.add_argument("--output-dir", help="(c)'s corpus directory (default WORKDIR/corpus-c); removed unless --keep")
    p.add_argument("--keep", action="store_true", help="keep the workdir and the corpus")
    p.add_argument("--rss-soak", type=int, default=0, metavar="N",
                   help="(c): then N x the prompt count more requests; server RSS at 10/50/100%%")
    p.add_argument("--codec-sample", type=int, metavar="FILES",
                   help="(c): measure the codecs on this many of the corpus files (0: no)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds an engine may take to start [900]")
    p.add_argument("--codec-only", action="store_true", help="run the codec measurement only (bench/codec.py)")
    p.add_argument("--transport-only", action="store_true",
                   help="run the HTTP client transport study only (tools/bench/transport.py; its own flags follow)")
    p.add_argument("--image-chat", action="store_true",
                   help="the image-chat workload only: hsx's states path vs vLLM's own prefill of the same chats "
                        "with images (tools/bench/image_chat.py; its own flags follow)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    argv = list(argv)
    if "--codec-only" in argv:
        argv.remove("--codec-only")
        from hsx_tools.bench.codec import main as codec_main

        return codec_main(argv)
    if "--image-chat" in argv:
        argv.remove("--image-chat")
        from hsx_tools.bench.image_chat import main as image_chat_main

        return image_chat_main(argv)
    if "--transport-only" in argv:
        argv.remove("--transport-only")
        from hsx_tools.bench.transport import main as transport_main

        return transport_main(argv)
    args = build_parser().parse_args(argv)
    if args.worker:
        from hsx_tools.bench.engines import worker_main

        return worker_main(args.worker)
    preset = PRESETS.get(args.preset or "", {})
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, preset.get(k, v))
    if not args.model and not args.make_model:
        if not preset:
            print("hsx bench: give --model DIR, --make-model SPEC, --quick or --h200", file=sys.stderr)
            return ExitCode.REFUSED
        args.make_model = preset["make_model"]
    args.transfers = [t.strip() for t in args.transfer.split(",") if t.strip()]
    if not args.transfers or {t.partition(":")[0] if t.startswith("http:") and t[5:] in ("none", "zstd", "bf16split")
                              else t for t in args.transfers} - {"auto", "http"}:
        print(f"hsx bench: --transfer {args.transfer!r}: a comma list of auto, http, http:none, http:zstd, "
              "http:bf16split", file=sys.stderr)
        return ExitCode.REFUSED
    if args.codec == "none":
        args.codec_kind, args.codec_level = "none", None
    elif args.codec == "bf16split":
        args.codec_kind, args.codec_level = "bf16split", 1
    elif args.codec.startswith("zstd"):
        args.codec_kind = "zstd"
        args.codec_level = int(args.codec.partition(":")[2] or 1)
    else:
        print(f"hsx bench: --codec {args.codec!r}: use zstd:LEVEL, bf16split or none", file=sys.stderr)
        return ExitCode.REFUSED
    # The client asks for identity with codec none (the server then sends raw bytes),
    # otherwise for zstd, even from this local server (its `auto` would not).
    args.compression = {"none": "none", "bf16split": "bf16split"}.get(args.codec_kind, "zstd")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODE_NAMES for m in modes):
        print(f"hsx bench: --modes {args.modes!r}: a comma list of a, b, c", file=sys.stderr)
        return ExitCode.REFUSED

    own_workdir = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hsx-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, modes, workdir)
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _result_header(args: argparse.Namespace, facts: dict[str, Any], itemsize: int, layers: list[int],
                   engine_flags: list[str]) -> dict[str, Any]:
    """The run's settings as the JSON result records them; each mode's figures go under "modes"."""
    return {
        "hsx_bench": 1,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "preset": args.preset,
        "model": facts,
        "model_spec": args.make_model,
        "dtype": args.dtype,
        "itemsize": itemsize,
        "layers": layers,
        "prompts": {"count": args.prompts, "length": args.prompt_len, "seed": args.seed, "warmup": args.warmup},
        "concurrency": args.concurrency,
        "codec": args.codec,
        "transfer": args.transfer,
        "client_process": args.client_process,
        "workers": args.workers,
        "max_buffer_bytes": args.max_buffer_bytes,
        "engine_flags": engine_flags,
        "server_args": args.server_arg,
        "hardware": hardware(),
        "modes": {},
    }


def _run_modes(args: argparse.Namespace, modes: list[str], workdir: Path, ctx: dict[str, Any],
               facts: dict[str, Any], result: dict[str, Any]) -> dict[str, str]:
    """Each mode in turn, its figures into result["modes"]; a failed mode is reported and the
    others still run. Returns {mode: why} of those that failed."""
    layers, itemsize = ctx["layers"], ctx["itemsize"]
    failures: dict[str, str] = {}
    for m in modes:
        log(f"===== mode ({m}) {MODE_NAMES[m]} =====")
        try:
            if m in ("a", "b"):
                from hsx_tools.bench.engines import run_engine_mode

                res = run_engine_mode(m, ctx, workdir, args.start_timeout + 1200)
            else:
                prompts = make_prompts(args.prompts, args.prompt_len, facts["vocab_size"], args.seed)
                warm = make_prompts(args.warmup, args.prompt_len, facts["vocab_size"], args.seed + 1)
                from hsx_tools.bench.mode_c import run_mode_c

                res = run_mode_c(ctx, args, workdir, prompts, warm, args.start_timeout)
                del prompts, warm
        except Exception as exc:  # report the others; exit 1 at the end
            failures[m] = f"{type(exc).__name__}: {exc}"
            log(f"mode ({m}) FAILED: {failures[m]}")
            continue
        res["gb_per_s"] = res["tokens_per_s"] * len(layers) * facts["hidden_size"] * itemsize / 1e9
        if m == "a":
            res["hs_bytes"] = res["tokens"] * len(layers) * facts["hidden_size"] * itemsize  # would-be
            res["hs_bytes_note"] = "nothing extracted; what the tokens would carry"
        result["modes"][m] = res
        if "versions" in res and "versions" not in result:
            result["versions"] = res["versions"]
    return failures


def _run(args: argparse.Namespace, modes: list[str], workdir: Path) -> int:
    ensure_packages(workdir)
    model = Path(args.model) if args.model and os.path.isdir(args.model) else None
    if args.make_model:
        model = ensure_model(args.make_model, workdir, args.prompt_len)
    if model is None:
        print("hsx bench: --model must be a local directory (its config.json gives the vocab and sizes)",
              file=sys.stderr)
        return ExitCode.REFUSED
    facts = model_facts(model)
    n = facts["num_hidden_layers"]
    layers = sorted({int(x) for x in args.layers.split(",")}) if args.layers else default_layers(n)
    if "c" in modes and len(layers) != 4:  # (c) writes an EAGLE-3 corpus: 3 aux layers + the last
        print(f"hsx bench: (c) needs 4 layers; {'--layers gives' if args.layers else 'the default gives'} "
              f"{layers} for this {n}-layer model: pass --layers with four ids", file=sys.stderr)
        return ExitCode.REFUSED
    itemsize = dtype_by_name(args.dtype).itemsize if args.dtype != "auto" else 2
    engine_flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len or args.prompt_len + 16),
                    "--no-enable-prefix-caching"]
    if args.enforce_eager:
        engine_flags.append("--enforce-eager")
    engine_flags += shlex.split(args.engine_args) + list(args.preset and PRESETS[args.preset]["engine_args"] or [])
    engine_flags += [a for x in args.engine_arg for a in shlex.split(x)]
    tokens = args.prompts * args.prompt_len
    ctx = {
        "model": str(model), "layers": layers, "hidden": facts["hidden_size"], "vocab": facts["vocab_size"],
        "itemsize": itemsize, "prompts": args.prompts, "prompt_len": args.prompt_len, "warmup": args.warmup,
        "seed": args.seed, "engine_flags": engine_flags,
        "hs_bytes_total": tokens * len(layers) * facts["hidden_size"] * itemsize,
    }
    log(f"{args.prompts} prompts x {args.prompt_len} tokens = {tokens:,} tokens; layers {layers} of {n}; "
        f"{fmt_bytes(ctx['hs_bytes_total'])} of states; engine flags: {' '.join(engine_flags)}")
    result = _result_header(args, facts, itemsize, layers, engine_flags)
    failures = _run_modes(args, modes, workdir, ctx, facts, result)
    result.setdefault("versions", versions_light())
    result["ratios"] = ratios(result["modes"])
    if failures:
        result["failures"] = failures
    if result["modes"]:
        print("\n" + format_table(result) + "\n", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {args.out}")
    if args.keep:
        log(f"kept {workdir}")
    return ExitCode.FAILED if failures else ExitCode.OK

