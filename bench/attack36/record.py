"""Merge one item's figures into the attack-36 results JSON, with the box's load average."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results-cpu-2026-12-05-attack36.json"


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def record(item: str, figures: dict) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"items": {}}
    data["items"][item] = {**data["items"].get(item, {}), **figures}
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":  # python record.py ITEM '{"k": v}'
    record(sys.argv[1], json.loads(sys.argv[2]))
