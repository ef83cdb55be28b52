"""Issue 36 items 2, 3 (and 5's verify) rerun, on one `hsx serve` at default settings.

2. Three `hsx extract --shard I/3` side by side on this loaded box: every sample stored, 0
   failed, expired leases counted in the summary; then one extract paused 3 s of every 3.7 s
   (SIGSTOP / SIGCONT) against a server with `--lease-timeout 2`: 0 failed, extra prefills
   counted (item2_paused.py).
3. The shards merged; `merged/hidden_states/hs_30` corrupted (through its hard link, so the
   shard's file too); `hsx verify merged` advice followed as printed; the merged corpus
   repaired in place, the shard's file not written through; then the shard repaired and
   `hsx merge` rerun into the same directory.

    python bench/attack36/item2_3_shards.py --work /tmp/a36-shards
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common import CHAT, TEMPLATES, env, hsx, load, serve
from record import record

INPUT = CHAT / "oasst" / "threads.messages.jsonl"


def extract_args(url: str, out: Path, *extra: str) -> list[str]:
    return ["extract", "--server", url, "--input", str(INPUT), "--output", str(out), "--format", "speculators",
            "--quiet", "--json", *extra]


def three_shards(url: str, work: Path) -> dict:
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "hsx_tools.cli", *extract_args(url, work / f"shard{i}", "--shard", f"{i}/3")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()) for i in range(3)]
    loads, outs = [], []
    while any(p.poll() is None for p in procs):
        loads.append(load())
        time.sleep(2)
    for p in procs:
        out, err = p.communicate()
        s = json.loads(out) if out.strip().startswith("{") else {"stderr": err[-400:]}
        outs.append({"exit": p.returncode, **{k: s.get(k) for k in ("planned", "done", "failed", "dropped",
                                                                    "retries", "leases_expired", "stderr")}})
    return {"shards": outs, "seconds": round(time.monotonic() - t0, 1), "load_max": max(loads, default=load()),
            "load_mean": round(sum(loads) / max(len(loads), 1), 2),
            "holds": all(o["exit"] == 0 and o["failed"] == 0 for o in outs)}


def advice(verify_out: str, url: str) -> list[list[str]]:
    """The `hsx extract --output DIR` commands `hsx verify` prints in backticks, "with its
    --server" added: what a user would run."""
    found = re.findall(r"`(hsx extract --output [^`]+)`", verify_out)
    return [shlex.split(cmd)[1:] + ["--server", url] for cmd in found]


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(64)
    with open(path, "r+b") as f:  # in place: the inode, so every link, sees it
        f.write(data)


def merged_repair(url: str, work: Path) -> dict:
    shards = [work / f"shard{i}" for i in range(3)]
    merged = work / "merged"
    m = hsx("merge", merged, *shards)
    fig = {"merge_exit": m.returncode}
    target = merged / "hidden_states" / "hs_30.safetensors"
    ino = target.stat().st_ino
    twin = next((f for s in shards for f in (s / "hidden_states").glob("*.safetensors") if f.stat().st_ino == ino), None)
    fig["hs_30_linked_to"] = str(twin.relative_to(work)) if twin else None
    corrupt(target)
    v = hsx("verify", merged)
    fig["verify_merged"] = {"exit": v.returncode, "out": [x for x in (v.stdout + v.stderr).strip().splitlines()
                                                          if not x.startswith("verify:")][-4:]}
    steps = advice(v.stdout + v.stderr, url)
    fig["advice"] = [" ".join(s) for s in steps]
    for step in steps:
        r = hsx(*step)
        fig.setdefault("advice_runs", []).append({"exit": r.returncode, "tail": (r.stdout + r.stderr).strip()[-300:]})
    v2 = hsx("verify", merged)
    fig["verify_merged_after"] = {"exit": v2.returncode, "line": (v2.stdout + v2.stderr).strip().splitlines()[-1:]}
    fig["merged_file_now_own_inode"] = target.stat().st_ino != ino
    if twin:
        vs = hsx("verify", twin.parents[1])
        fig["shard_verify_after_merged_repair"] = {"exit": vs.returncode,
                                                   "line": (vs.stdout + vs.stderr).strip().splitlines()[-1:]}
        steps = advice(vs.stdout + vs.stderr, url)
        for step in steps:
            hsx(*step)
        vs2 = hsx("verify", twin.parents[1])
        fig["shard_repaired"] = {"advice": [" ".join(s) for s in steps], "verify_exit": vs2.returncode,
                                 "shard_file_linked_back": twin.stat().st_ino == target.stat().st_ino}
        rm = hsx("merge", merged, *shards)
        fig["remerge_same_dir"] = {"exit": rm.returncode, "tail": (rm.stdout + rm.stderr).strip()[-300:]}
        v3 = hsx("verify", merged)
        fig["verify_after_remerge"] = v3.returncode
        fig["verify_after_remerge_line"] = (v3.stdout + v3.stderr).strip().splitlines()[-1:]
    fig["holds"] = (fig["verify_merged"]["exit"] != 0 and fig["verify_merged_after"]["exit"] == 0
                    and fig["merged_file_now_own_inode"] and fig.get("remerge_same_dir", {}).get("exit") == 0
                    and fig.get("verify_after_remerge") == 0
                    and fig.get("shard_verify_after_merged_repair", {}).get("exit") != 0)
    return fig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--label", default="three_shards_default")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    server = serve("--chat-template", str(TEMPLATES / "llama3.jinja"), name="item2-3")
    try:
        before = load()
        shards = three_shards(server.url, args.work)
        record("2", {args.label: {**shards, "load": max(before, load())}})
        print(json.dumps(shards, indent=1), flush=True)
        before = load()
        repair = merged_repair(server.url, args.work)
        record("3", {**repair, "load": max(before, load())})
        print(json.dumps(repair, indent=1), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
