"""Issue 36.7 rerun: the README's regeneration command on the CPU set-up it recommends.
`--seed 1 --temperature 0.6` against a CPU server is refused by a pre-flight request in one
line before any work (exit 2), locks nothing (the same --output then takes other settings),
and the README's command as printed runs, its text summary naming every drop and failure.

    hsx serve stories260K --chat-template llama3.jinja &
    python bench/attack36/item7_regen_preflight.py --url http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import CHAT, hsx, load
from record import record


def run_readme(common: list, max_tokens: str, corpus: Path) -> dict:
    out = common[common.index("--output") + 1]
    r = hsx(*common, "--max-tokens", max_tokens, "--temperature", "0.6", "--chat-template-kwargs",
            '{"enable_thinking": true}', "--extract-to", corpus, "--", "--format", "speculators")
    rows = len(out.read_text().splitlines()) if out.exists() else 0
    return {"exit": r.returncode, "rows": rows, "corpus_samples": len(list(corpus.glob("hidden_states/*"))),
            "lines": [x for x in (r.stdout + r.stderr).splitlines() if x.startswith(("hsx", "status"))][-4:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--scaled-max-tokens", type=int, default=256)
    args = p.parse_args()
    before = load()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        out = work / "regen.jsonl"
        common = ["regenerate", "--server", args.url, "--input", CHAT / "oasst" / "threads.messages.jsonl",
                  "--output", out, "--max-conversations", str(args.conversations), "--quiet"]
        t0 = time.monotonic()
        seeded = hsx(*common, "--seed", "1", "--temperature", "0.6")
        seeded_s = round(time.monotonic() - t0, 2)
        stored = out.exists() and out.read_text().strip() != ""
        # The README's command as printed (less --seed, which it says is for GPU servers), same --output;
        # then with --max-tokens scaled to stories260K's 512-token context, into a new one.
        readme = run_readme(common, "2048", work / "corpus")
        common[common.index(out)] = work / "scaled.jsonl"
        scaled = run_readme(common, str(args.scaled_max_tokens), work / "corpus-scaled")
    seeded_lines = [line for line in (seeded.stdout + seeded.stderr).splitlines() if line.strip()]
    figures = {"seeded": {"exit": seeded.returncode, "seconds": seeded_s, "lines": seeded_lines[-3:],
                          "line_count": len(seeded_lines), "stored_anything": stored},
               "readme_command_as_printed_same_output": readme,
               f"readme_command_max_tokens_{args.scaled_max_tokens}": scaled,
               "load": max(before, load())}
    figures["holds"] = (seeded.returncode == 2 and len(seeded_lines) == 1 and not stored
                        and "started with other settings" not in " ".join(readme["lines"])
                        and scaled["exit"] == 0 and scaled["rows"] > 0)
    record("7", figures)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
