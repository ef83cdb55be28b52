"""The report of bench/draft_quality.py: hsx's corpus against the reference's, the runs'
figures summed over seeds, and the plot of both (the driver is draft_quality.py).
`python bench/draft_quality_report.py REPORT.json [--plot FILE.png]` draws a recorded report again."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def compare_states(a: Path, b: Path) -> dict[str, Any]:
    """hsx's corpus against the reference's, file by file, as speculators' file backend reads
    them: how many rows are bit-equal, and the largest difference (absolute, and relative to
    the row's largest state)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(p.name for p in (a / "hidden_states").glob("hs_*.safetensors"))
    equal, worst_abs, worst_rel, missing = 0, 0.0, 0.0, 0
    for name in files:
        if not (b / "hidden_states" / name).exists():
            missing += 1
            continue
        x, y = load_file(str(a / "hidden_states" / name)), load_file(str(b / "hidden_states" / name))
        if not torch.equal(x["token_ids"], y["token_ids"]):
            raise SystemExit(f"{name}: the token ids of hsx's and the reference's rows differ")
        hx, hy = x["hidden_states"].float(), y["hidden_states"].float()
        equal += bool(torch.equal(hx, hy))
        d = (hx - hy).abs().max().item()
        worst_abs, worst_rel = max(worst_abs, d), max(worst_rel, d / max(hy.abs().max().item(), 1e-30))
    return {"rows": len(files), "bit_equal_rows": equal, "missing_in_reference": missing,
            "max_abs_diff": worst_abs, "max_rel_diff": worst_rel}


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(runs: dict[str, dict[int, dict]]) -> dict[str, Any]:
    """Per run: the mean over seeds of the acceptance figures and the last loss, and the
    seeds' spread (max - min of mean acceptance length: the noise the comparison is read against)."""
    out = {}
    for name, seeds in runs.items():
        mal = [s["acceptance"].get("mean_acceptance_length") for s in seeds.values()]
        pos = [s["acceptance"].get("acceptance_rate_per_position") or [] for s in seeds.values()]
        final = [s["loss_curve"][-1].get("loss_0") if s["loss_curve"] else None for s in seeds.values()]
        width = min((len(p) for p in pos), default=0)
        out[name] = {"mean_acceptance_length": mean(mal),
                     "seed_spread": (max(mal) - min(mal)) if len(mal) > 1 and None not in mal else None,
                     "acceptance_rate_per_position": [mean([p[i] for p in pos]) for i in range(width)],
                     "final_loss_0": mean(final)}
    return out


def plot(report: dict, path: Path) -> str | None:
    """Loss curves (loss_0 per step) and acceptance rate per position, one colour per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, seeds) in enumerate(report["runs"].items()):
        colour = f"C{i}"
        for seed, r in seeds.items():
            ax1.plot([s.get("loss_0") for s in r["loss_curve"]], color=colour, alpha=0.8,
                     label=f"{name} (seed {seed})")
        summary = report["summary"][name]
        rates = summary["acceptance_rate_per_position"]
        if rates and summary["mean_acceptance_length"] is not None:
            mal = summary["mean_acceptance_length"]
            ax2.plot(range(1, len(rates) + 1), rates, marker="o", color=colour,
                     label=f"{name}: mean acceptance length {mal:.3f}")
    ax1.set(xlabel="step", ylabel="train loss_0", title="draft training loss")
    ax2.set(xlabel="draft position", ylabel="acceptance rate", title="EAGLE-3 acceptance (held-out prompts)",
            ylim=(0, 1))
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(report["label"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Draw a recorded draft_quality report again.")
    p.add_argument("report", type=Path, help="the JSON bench/draft_quality.py wrote")
    p.add_argument("--plot", type=Path, help="the PNG to write [REPORT with .png]")
    a = p.parse_args(argv)
    why = plot(json.loads(a.report.read_text()), a.plot or a.report.with_suffix(".png"))
    if why:
        print(why, file=sys.stderr)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
