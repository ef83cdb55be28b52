"""Issue 36.5 rerun: summaries that agree with the files.

    python item5_summaries.py regen --url URL      # hsx regenerate: uninterrupted vs killed + resumed
    python item5_summaries.py verify --merged DIR  # hsx verify on a merged corpus vs its hsx_corpus.json
    python item5_summaries.py window               # --stream-window-bytes below 64 KiB: one line

`verify` takes the merged corpus item 3's script leaves (item3_merged_repair.py --keep DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import CHAT, STORIES, env, hsx, load
from record import record


def regen_command(url: str, out: Path, n: int) -> list[str]:
    return [sys.executable, "-m", "hsx_tools.cli", "regenerate", "--server", url, "--input",
            str(CHAT / "oasst" / "threads.messages.jsonl"), "--output", str(out), "--max-conversations", str(n),
            "--max-tokens", "64", "--concurrency-per-server", "2", "--quiet"]


def last_line(r) -> str:
    return [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("hsx regenerate")][-1:] or [""]


def regen(url: str, n: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        whole = subprocess.run(regen_command(url, work / "a.jsonl", n), capture_output=True, text=True, env=env())
        cut = work / "b.jsonl"
        proc = subprocess.Popen(regen_command(url, cut, n), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env(), start_new_session=True)
        journal = Path(f"{cut}.hsx-regen") / "journal.jsonl"  # the output is written from it at the end
        while proc.poll() is None and (not journal.exists() or len(journal.read_text().splitlines()) < n // 3):
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rows_at_kill = len(journal.read_text().splitlines()) if journal.exists() else 0
        resumed = subprocess.run(regen_command(url, cut, n), capture_output=True, text=True, env=env())
        rows = [len((work / f).read_text().splitlines()) for f in ("a.jsonl", "b.jsonl")]
    a, b = last_line(whole)[0], last_line(resumed)[0]
    head = lambda s: s.split(";")[0].split(" in ")[0]  # noqa: E731  "N of M conversations"
    return {"conversations": n, "uninterrupted": a, "journaled_at_kill": rows_at_kill, "resumed": b,
            "rows_written": rows, "same_counts": head(a) == head(b) and rows[0] == rows[1]}


def verify(merged: Path) -> dict:
    record_ = json.loads((merged / "hsx_corpus.json").read_text())
    r = hsx("verify", merged)
    line = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("verify")][-1:]
    counts = record_["counts"]
    said = re.search(r"(\d+) failed at extraction.*?(\d+) dropped", line[0] if line else "")
    return {"hsx_corpus_counts": counts, "verify_exit": r.returncode, "verify_line": line,
            "agree": bool(said) and [int(said[1]), int(said[2])] == [counts.get("global_failed", counts["failed"]),
                                                                  counts.get("global_dropped", counts["dropped"])]}


def window() -> dict:
    r = hsx("serve", STORIES, "--port", "0", "--stream-window-bytes", "1000", timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    ours = [x for x in lines if x.startswith("hsx serve")]  # besides, one import notice from torch/vLLM
    return {"exit": r.returncode, "lines": lines[-3:], "line_count": len(lines), "hsx_line_count": len(ours),
            "pydantic_or_traceback": "pydantic" in r.stderr or "Traceback" in r.stderr,
            "holds": r.returncode == 2 and len(ours) == 1 and "pydantic" not in r.stderr}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["regen", "verify", "window"])
    p.add_argument("--url")
    p.add_argument("--merged", type=Path)
    p.add_argument("--conversations", type=int, default=30)
    args = p.parse_args()
    before = load()
    figures = {"regen": lambda: regen(args.url, args.conversations), "verify": lambda: verify(args.merged),
               "window": window}[args.what]()
    figures["load"] = max(before, load())
    record("5", {args.what: figures})
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
