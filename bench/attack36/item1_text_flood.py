"""Issue 36.1 rerun: 24 x 3.9 MB chats to /v1/chat/completions (max_tokens 4) while another
client sends two-message chats; bench/text_flood.py does the attack, this records it.

    python bench/attack36/item1_text_flood.py --url http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from record import load, record

HERE = Path(__file__).resolve().parent


def run(url: str, other: str, seconds: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        before = load()
        subprocess.run([sys.executable, str(HERE.parent / "text_flood.py"), "--url", url, "--flood", "24",
                        "--mb", "3.9", "--seconds", str(seconds), "--other-address", other,
                        "--out", out.name], check=True)
        r = json.loads(Path(out.name).read_text())
    u = r["under_flood"]
    return {"other_address": other, "quiet_p50_s": r["quiet"]["p50_s"], "p50_s": u["p50_s"],
            "p99_s": u["p99_s"], "max_s": u["max_s"], "n": u["n"], "flood_answers": r["flood_answers"],
            "load": max(before, load())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    other_peer = run(args.url, "127.0.0.2", args.seconds)
    same_peer = run(args.url, "127.0.0.1", args.seconds)
    worst = max(other_peer["p99_s"], same_peer["p99_s"])
    record("1", {"other_peer": other_peer, "same_peer": same_peer, "p99_s": other_peer["p99_s"],
                 "load": other_peer["load"], "holds": worst < 1.0})
    print(json.dumps({"other_peer": other_peer, "same_peer": same_peer}, indent=1))


if __name__ == "__main__":
    main()
