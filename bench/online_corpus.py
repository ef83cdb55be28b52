#!/usr/bin/env python
"""fp8 corpora and token tables on real activations: `python bench/online_corpus.py [flags]`.

For each model (default: the shared stories260K and a random bf16 Llama 6 x 256), served
with `hsx serve --dtype bfloat16` and the shared llama3 template, on the same real chats
(the shared OASST threads, one sample per assistant turn):
  1. `hsx extract --format speculators --states none`, then the full corpus (bf16 states)
     and `--dtype fp8`, each timed (wall: the whole command, after 16 untimed warm-up samples);
  2. the bf16 and fp8 corpora read back with speculators' own readers (ArrowDataset with
     the file backend, and hs_connectors' FP8Transfer, which dequantizes to bf16): the
     error of fp8 against bf16 per layer (relative L2 over all tokens, and the worst
     sample), and the disk of both (hidden_states/ and the whole corpus).
Prints a table; `--out FILE` writes every figure as JSON. See README.md, "fp8 corpora".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "fixtures"
THREADS = SHARED / "chat" / "oasst" / "threads.messages.jsonl"
TEMPLATE = SHARED / "chat_templates" / "llama3.jinja"


def _disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _extract(url: str, out: Path, args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hsx_tools.cli", "extract", "--server", url, "--output", str(out), "--quiet",
                    *args], check=True)
    return time.perf_counter() - t


def phase_seconds(url: str) -> dict[str, float]:
    """The server's own time per request phase so far (hsx_phase_seconds sums)."""
    from hsx_tools.server_process import read_metrics

    return read_metrics(url, timeout=30).by_label("hsx_phase_seconds_sum", "phase")


def fp8_error(bf16: Path, fp8: Path) -> dict:
    """fp8 (dequantized by speculators' fp8 backend) against the bf16 corpus, per layer."""
    import torch
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    a = ArrowDataset(1 << 20, str(bf16), on_missing="raise", train_ratio=1.0)
    b = ArrowDataset(1 << 20, str(fp8), transfer=FP8Transfer(fp8 / "hidden_states"), on_missing="raise", train_ratio=1.0)
    err2 = ref2 = None
    worst = 0.0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]), f"row {i}: token ids differ"
        h = x["verifier_last_hidden_states"].shape[-1]
        rx = torch.cat([x["hidden_states"].view(-1, 3, h), x["verifier_last_hidden_states"].unsqueeze(1)], 1).float()
        ry = torch.cat([y["hidden_states"].view(-1, 3, h), y["verifier_last_hidden_states"].unsqueeze(1)], 1).float()
        e2, r2 = ((ry - rx) ** 2).sum((0, 2)), (rx**2).sum((0, 2))
        err2, ref2 = (e2, r2) if err2 is None else (err2 + e2, ref2 + r2)
        worst = max(worst, float(((ry - rx).norm() / rx.norm()).item()))
    per_layer = (err2 / ref2).sqrt().tolist()
    return {"rows": len(a), "rel_l2_per_layer": per_layer, "rel_l2_all": float((err2.sum() / ref2.sum()).sqrt()),
            "worst_sample_rel_l2": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/online_corpus.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=[], help="model dir (repeatable; default: stories260K + random)")
    p.add_argument("--make-model", default="layers=6,hidden=256,ffn=512,heads=4,kv_heads=2,vocab=1024,dtype=bfloat16")
    p.add_argument("--samples", type=int, default=300, help="samples per corpus (--max-samples) [300]")
    p.add_argument("--max-length", type=int, default=480, help="tokens per sample at most [480]")
    p.add_argument("--input", default=str(THREADS), help="chats (JSONL messages) [the shared OASST threads]")
    p.add_argument("--workdir")
    p.add_argument("--out", help="write the JSON result here")
    a = p.parse_args(argv)

    from hsx_tools.bench.common import child_env, ensure_model, ensure_packages, hardware, log, model_facts
    from hsx.layers import default_layers
    from hsx_tools.server_process import ServerProcess

    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="hsx-online-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ensure_packages(workdir)
    models = list(a.model) or [str(SHARED / "models" / "stories260K"), str(ensure_model(a.make_model, workdir, a.max_length))]
    common = ["--input", a.input, "--format", "speculators", "--max-samples", str(a.samples),
              "--max-length", str(a.max_length), "--truncation", "left"]
    results = []
    for model in models:
        facts = model_facts(Path(model))
        n = facts["num_hidden_layers"]
        name = Path(model).name
        label = f"{'random Llama' if name.startswith('model-') else name[:16]} {n}x{facts['hidden_size']}"
        server = ServerProcess(model, "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(a.max_length + 16),
                               "--layers", ",".join(map(str, default_layers(n))), "--chat-template", str(TEMPLATE),
                               log_path=workdir / f"serve-{len(results)}.log", env=child_env())
        try:
            server.wait_ready(900)
            d = workdir / f"m{len(results)}"
            _extract(server.url, d / "warmup", [*common, "--max-samples", "16"])  # the engine's first requests
            times, phases = {}, {}
            for k, extra in (("tokens", ["--states", "none"]), ("bf16", []), ("fp8", ["--dtype", "fp8"])):
                before = phase_seconds(server.url)
                times[k] = _extract(server.url, d / k, common + extra)
                phases[k] = {p: v - before.get(p, 0.0) for p, v in phase_seconds(server.url).items()}
        finally:
            server.stop()
        err = fp8_error(d / "bf16", d / "fp8")
        row = {
            "model": label, **err, "seconds": times, "server_phase_seconds_bf16": phases["bf16"],
            "disk_bytes": {k: _disk(d / k) for k in times},
            "states_bytes": {k: _disk(d / k / "hidden_states") for k in ("bf16", "fp8")},
            "tokens": json.loads((d / "bf16" / "hsx_corpus.json").read_text())["counts"]["tokens"],
        }
        row["states_ratio"] = row["states_bytes"]["fp8"] / row["states_bytes"]["bf16"]
        row["disk_ratio"] = row["disk_bytes"]["fp8"] / row["disk_bytes"]["bf16"]
        results.append(row)
        log(f"{label}: done")

    print(f"\n{'model':<22} {'rows':>5} {'tokens':>8} {'fp8/bf16 states':>15} {'fp8/bf16 corpus':>15} "
          f"{'fp8 rel. L2 per layer (vs bf16)':>34} {'worst sample':>12}")
    for r in results:
        layers = " ".join(f"{x:.4f}" for x in r["rel_l2_per_layer"])
        print(f"{r['model']:<22} {r['rows']:>5} {r['tokens']:>8} {r['states_ratio']:>15.3f} {r['disk_ratio']:>15.3f} "
              f"{layers:>34} {r['worst_sample_rel_l2']:>12.4f}")
    print(f"\n{'model':<22} {'full extract s':>14} {'--dtype fp8 s':>13} {'--states none s':>15} "
          f"{'server s: tokenize':>18} {'engine':>7} {'copy':>6} {'send':>6}  (full run)")
    for r in results:
        s, ph = r["seconds"], r["server_phase_seconds_bf16"]
        print(f"{r['model']:<22} {s['bf16']:>14.1f} {s['fp8']:>13.1f} {s['tokens']:>15.1f} {ph.get('tokenize', 0):>18.2f} "
              f"{ph.get('engine', 0):>7.2f} {ph.get('copy', 0):>6.2f} {ph.get('send', 0):>6.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"hsx_online_corpus_bench": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                           "hardware": hardware(), "samples": a.samples, "max_length": a.max_length,
                                           "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
