"""Issue 36.9 rerun: the docs against the tool, as a newcomer reads them.

    python bench/attack36/item9_docs.py [--corpus DIR]

--corpus: a speculators corpus `hsx extract` wrote (e.g. a shard of item2_3_shards.py) to run
the documented loading recipe (docs/examples/load_corpus.py) on.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from common import REPO, env, hsx, load
from record import record


def section(readme: str, title: str) -> str:
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ )", readme, re.S | re.M)
    return m.group(1) if m else ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", type=Path)
    args = p.parse_args()
    before = load()
    readme = (REPO / "README.md").read_text()
    on_cpu = section(readme, "On CPU")
    bench = section(readme, "Benchmark")
    serve_help = hsx("serve", "--help=hsx").stdout
    flags = [ln for ln in serve_help.splitlines() if ln.strip().startswith("--")]
    demo_help = hsx("demo", "--help").stdout
    top_help = hsx("--help")
    fig = {
        "on_cpu_says_hsx_sets_kvcache": "sets it" in on_cpu and "fails to start" not in on_cpu,
        "loading_doc": (REPO / "docs" / "loading-a-corpus.md").exists() and "docs/loading-a-corpus.md" in readme,
        "demo_has_port": "--port" in demo_help,
        "demo_says_about_a_minute": "about a minute" in demo_help or "about a minute" in readme,
        "serve_help_default_none": serve_help.count("(default: None)"),
        "serve_help_flags": len(flags),
        "help_lists_kimi_k25": "kimi_k25" in top_help.stdout + top_help.stderr,
        "readme_says_0.62x": "0.62x" in readme,
        "benchmark_leads_with_table": bench.lstrip().find("|") < bench.find("bench/README.md") + 400,
    }
    if args.corpus:
        r = subprocess.run([sys.executable, str(REPO / "docs" / "examples" / "load_corpus.py"), str(args.corpus),
                            "--max-len", "512"], capture_output=True, text=True, env=env(), timeout=600)
        fig["load_corpus_example"] = {"exit": r.returncode, "tail": r.stdout.strip().splitlines()[-2:],
                                      "stderr": r.stderr.strip().splitlines()[-2:] if r.returncode else []}
    fig["holds"] = (fig["on_cpu_says_hsx_sets_kvcache"] and fig["loading_doc"] and fig["demo_has_port"]
                    and not fig["demo_says_about_a_minute"] and fig["serve_help_default_none"] == 0
                    and fig["help_lists_kimi_k25"] and not fig["readme_says_0.62x"]
                    and (not args.corpus or fig["load_corpus_example"]["exit"] == 0))
    fig["load"] = max(before, load())
    record("9", fig)
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    main()
