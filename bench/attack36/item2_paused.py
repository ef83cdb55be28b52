"""Issue 36.2 rerun, second half: one `hsx extract` paused 3 s of every 3.7 s (SIGSTOP /
SIGCONT: a client starved of CPU) against `hsx serve --lease-timeout 2`. Every sample stored,
0 failed; leases that expired are asked again over HTTP and counted in the summary (before:
0 failed but 161 extra prefills for 672 samples).

    python bench/attack36/item2_paused.py [--samples 300]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import CHAT, TEMPLATES, env, load, serve
from record import record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=300)
    args = p.parse_args()
    server = serve("--chat-template", str(TEMPLATES / "llama3.jinja"), "--lease-timeout", "2", name="item2-paused")
    try:
        before = load()
        with tempfile.TemporaryDirectory() as work:
            cmd = [sys.executable, "-m", "hsx_tools.cli", "extract", "--server", server.url, "--input",
                   str(CHAT / "oasst" / "threads.messages.jsonl"), "--output", str(Path(work) / "c"), "--format",
                   "speculators", "--max-samples", str(args.samples), "--quiet", "--json"]
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                    start_new_session=True)
            pauses = 0
            while proc.poll() is None:
                time.sleep(0.7)
                try:
                    os.killpg(proc.pid, signal.SIGSTOP)
                    time.sleep(3.0)
                    os.killpg(proc.pid, signal.SIGCONT)
                    pauses += 1
                except ProcessLookupError:
                    break
            out, err = proc.communicate()
            seconds = time.monotonic() - t0
        s = json.loads(out) if out.strip().startswith("{") else {}
        m = server.metrics()
        expired_server = m.get("hsx_leases_total", 0, outcome="expired")
    finally:
        server.stop()
    figures = {"lease_timeout_s": 2, "pauses": pauses, "seconds": round(seconds, 1), "exit": proc.returncode,
               **{k: s.get(k) for k in ("planned", "done", "failed", "dropped", "retries", "leases_expired")},
               "leases_expired_server": int(expired_server), "stderr_tail": err.strip().splitlines()[-2:],
               "load": max(before, load())}
    figures["holds"] = proc.returncode == 0 and s.get("failed") == 0
    record("2", {"paused_client_lease_timeout_2": figures})
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
