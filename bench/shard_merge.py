"""Shard and merge times: one client over two servers vs two shard clients (one per server,
as two nodes would run them) and `hsx merge` of their shards, on the same input.

    python bench/shard_merge.py                          # 200 OASST conversations, both formats
    python bench/shard_merge.py --conversations 1000 --formats speculators --out r.json

Two `hsx serve` processes (the trained stories260K from ../shared/fixtures, fp32, layers
1,2,4,5, llama3 chat template) run on this machine; each timed step is the real command
line as a subprocess, start-up included (`elapsed` is the run loop alone, from the
command's own summary): (1) `hsx extract` over both servers, the single-client baseline;
(2) `hsx extract --shard 0/2` against server A and `--shard 1/2` against server B at the
same time (each reads its server's states over leases); (3) `hsx merge` of the two shards;
(4) `hsx verify` of the merged corpus. It checks that the merged corpus holds the baseline's
keys in the same order, and prints the ratios to the baseline. On one machine the two
"nodes" share its cores, so (2) shows the cost of sharding, not the gain of more nodes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hsx_tools.bench.common import child_env, hardware
from hsx_tools.server_process import ServerProcess as Server

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"
HSX = [sys.executable, "-m", "hsx_tools.cli"]
LAYERS = "1,2,4,5"


def run(argv: list[str], log: Path) -> tuple[float, dict]:
    t0 = time.monotonic()
    with open(log, "ab") as err:
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, env=child_env(), timeout=3600)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"{argv[3]} exited {r.returncode}; see {log}")
    return wall, json.loads(r.stdout)


def extract_argv(servers: list[Server], out: Path, inputs: Path, fmt: str, *extra: str) -> list[str]:
    argv = [*HSX, "extract", "--output", str(out), "--input", str(inputs), "--format", fmt,
            "--mask-policy", "all_turns", "--max-length", "384", "--draft-vocab-size", "64", "--quiet", "--json", *extra]
    for s in servers:
        argv += ["--server", s.url]
    return argv


def one_format(fmt: str, a: Server, b: Server, inputs: Path, work: Path) -> dict:
    log = work / f"{fmt}.log"
    res: dict = {"format": fmt}
    single = work / f"{fmt}-single"
    res["single_wall_s"], s = run(extract_argv([a, b], single, inputs, fmt), log)
    res["single_elapsed_s"], res["samples"], res["tokens"] = s["elapsed_s"], s["done"], s["tokens"]

    t0 = time.monotonic()
    procs = []
    for i, server in enumerate((a, b)):
        argv = extract_argv([server], work / f"{fmt}-shard-{i}", inputs, fmt, "--shard", f"{i}/2")
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "ab"), env=child_env()))
    shard_summaries = []
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"a shard exited {p.returncode}; see {log}")
        shard_summaries.append(json.loads(out))
    res["shards_wall_s"] = time.monotonic() - t0
    res["shard_elapsed_s"] = [s["elapsed_s"] for s in shard_summaries]
    res["shard_samples"] = [s["done"] for s in shard_summaries]
    res["shard_transfer"] = [next(iter(s["servers"].values())).get("transfer") for s in shard_summaries]

    merged = work / f"{fmt}-merged"
    res["merge_wall_s"], m = run([*HSX, "merge", str(merged), *(str(work / f"{fmt}-shard-{i}") for i in (0, 1)),
                                  "--quiet", "--json"], log)
    res["merge_elapsed_s"], res["merge_linked"], res["merge_copied"] = m["seconds"], m["linked"], m["copied"]
    t0 = time.monotonic()
    v = subprocess.run([*HSX, "verify", str(merged), "--quiet", "--json"], capture_output=True, text=True,
                       env=child_env(), timeout=3600)
    res["verify_wall_s"] = time.monotonic() - t0
    res["verify_ok"] = v.returncode == 0 and json.loads(v.stdout)["ok"]
    keys = [json.loads((d / "plan.json").read_text())["keys"] for d in (merged, single)]
    res["same_keys_same_order"] = keys[0] == keys[1]
    res["ratios"] = {
        "shards_wall / single_wall": res["shards_wall_s"] / res["single_wall_s"],
        "merge_wall / shards_wall": res["merge_wall_s"] / res["shards_wall_s"],
        "(shards + merge) / single": (res["shards_wall_s"] + res["merge_wall_s"]) / res["single_wall_s"],
    }
    return res


def table(results: list[dict], n: int) -> str:
    lines = [f"{n} OASST conversations (all_turns: one sample each), stories260K fp32 on 2 local servers", ""]
    for r in results:
        lines += [
            f"[{r['format']}] {r['samples']} samples, {r['tokens']:,} tokens",
            f"  (1) one client, 2 servers     {r['single_wall_s']:7.2f} s wall  ({r['single_elapsed_s']:.2f} s run loop)",
            f"  (2) 2 shard clients at once   {r['shards_wall_s']:7.2f} s wall  (run loops "
            f"{', '.join(f'{x:.2f}' for x in r['shard_elapsed_s'])} s; {r['shard_samples']} samples; "
            f"transfer {', '.join(map(str, r['shard_transfer']))})",
            f"  (3) hsx merge                 {r['merge_wall_s']:7.2f} s wall  ({r['merge_elapsed_s']:.2f} s inside; "
            f"{r['merge_linked']} linked, {r['merge_copied']} copied)",
            f"  (4) hsx verify merged         {r['verify_wall_s']:7.2f} s wall  (ok: {r['verify_ok']}; "
            f"same keys, same order as (1): {r['same_keys_same_order']})",
            "  ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in r["ratios"].items()),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--formats", default="speculators,specforge")
    p.add_argument("--workdir", type=Path, help="keep the corpora here (default: a temporary dir)")
    p.add_argument("--out", type=Path, help="write every figure as JSON")
    args = p.parse_args(argv)
    model, template = FIXTURES / "models" / "stories260K", FIXTURES / "chat_templates" / "llama3.jinja"
    threads = FIXTURES / "chat" / "oasst" / "threads.messages.jsonl"
    if not model.exists():
        raise SystemExit(f"needs the shared fixtures at {FIXTURES}")
    with tempfile.TemporaryDirectory(prefix="hsx-shard-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        inputs = work / "conversations.jsonl"
        inputs.write_text("".join(threads.read_text().splitlines(keepends=True)[: args.conversations]))
        flags = ["--dtype", "float32", "--layers", LAYERS, "--chat-template", str(template), "--max-num-seqs", "16"]
        servers = [Server(str(model), *flags, log_path=work / f"server-{c}.log", env=child_env()) for c in "ab"]
        try:
            for s in servers:
                s.wait_ready(900)
            results = [one_format(fmt, *servers, inputs, work) for fmt in args.formats.split(",")]
        finally:
            for s in servers:
                s.stop()
    report = {"date": time.strftime("%Y-%m-%d"), "conversations": args.conversations, "hardware": hardware(),
              "results": results}
    print(table(results, args.conversations))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["verify_ok"] and r["same_keys_same_order"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
