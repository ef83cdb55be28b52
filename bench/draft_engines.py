#!/usr/bin/env python
"""The vLLM halves of bench/draft_quality.py, each in its own child process (its engine
and accelerator memory are gone before the next step starts):

    python bench/draft_engines.py reference CONFIG.json   # the reference pipeline's corpus
    python bench/draft_engines.py accept CONFIG.json      # acceptance of one EAGLE-3 draft

`reference`: vLLM's own `extract_hidden_states` with its file connector (on CPU, hsx bench's
synchronous twin of it) over the token table's rows, each file waited for (its `.lock`),
moved into place and checked exactly as speculators' `generate-offline-data` does
(`hidden_states/hs_{i}.safetensors`, then `check_hidden_states`), so speculators' file
backend reads it as its own.

`accept`: the target served with EAGLE-3 speculative decoding and the draft, greedy, on the
held-out prompts; vLLM's own spec-decode counters give the acceptance figures.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _engine_kwargs(cfg: dict) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from hsx_tools.bench.engines import engine_kwargs

    return engine_kwargs(cfg["model"], cfg.get("engine_flags", []))



def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):  # os._exit below would leave the engine core orphaned
        core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the stock connector's writer threads can hold interpreter exit


def keep_states(path: str, dest: Path) -> Path:
    """One response's states file moved to `dest`, as generate-offline-data keeps it: first
    wait for the connector's write. The connector reports a request finished once its
    states are out of the KV cache (the stock one: once the copy to the host is done); a
    writer thread writes the file afterwards, holding an exclusive lock on `PATH.lock` that
    the worker took before the path was returned. Without the wait the last rows of a
    batch can be read before they exist."""
    lock = f"{path}.lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the writer releases its lock
        os.remove(lock)
    shutil.move(path, dest)
    return dest


def reference(cfg: dict) -> None:
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = Path(cfg["out"]) / "hidden_states"
    out.mkdir(parents=True, exist_ok=True)
    table = load_from_disk(cfg["table"]).with_format(None)
    rows = [list(r) for r in table["input_ids"]]
    kw = _engine_kwargs(cfg)
    staging = tempfile.mkdtemp(prefix="hsx-draftq-ref-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    from hsx_tools.bench.engines import with_vllm_file_path  # importable once _engine_kwargs set the path

    with_vllm_file_path(kw, cfg["layers"], staging)
    try:  # a failed run leaves no states in /dev/shm
        llm = LLM(**kw)
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], sp, use_tqdm=False)
        for i, (row, o) in enumerate(zip(rows, outs)):
            kept = keep_states(o.kv_transfer_params["hidden_states_path"], out / f"hs_{i}.safetensors")
            check_hidden_states(load_file(kept), row)  # what generate-offline-data checks in the file it keeps
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    Path(cfg["result"]).write_text(json.dumps({"rows": len(rows), "engine_kwargs": {k: str(v) for k, v in kw.items()}}))
    _shutdown(llm)


def acceptance(metrics: list) -> dict[str, Any]:
    """vLLM's spec-decode counters -> mean acceptance length (1 + accepted per draft: the
    tokens each target step yields) and the acceptance rate per draft position."""
    got: dict[str, Any] = {}
    for m in metrics:
        name = m.name.removesuffix("_total")
        if name.startswith("vllm:spec_decode_"):
            got[name.removeprefix("vllm:spec_decode_")] = getattr(m, "values", None) or getattr(m, "value", 0)
    drafts = int(got.get("num_drafts", 0))
    per_pos = [int(x) for x in got.get("num_accepted_tokens_per_pos", [])]
    accepted, drafted = int(got.get("num_accepted_tokens", 0)), int(got.get("num_draft_tokens", 0))
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "accepted_per_position": per_pos,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_rate_per_position": [x / drafts for x in per_pos] if drafts else None}


def accept(cfg: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = _engine_kwargs(cfg)
    kw["disable_log_stats"] = False  # the spec-decode counters
    kw["seed"] = cfg.get("seed", 0)
    if cfg.get("draft"):
        kw["speculative_config"] = {"method": "eagle3", "model": cfg["draft"],
                                    "num_speculative_tokens": cfg["num_speculative_tokens"]}
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]], sp, use_tqdm=False)
    res = acceptance(llm.get_metrics()) if cfg.get("draft") else {}
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    Path(cfg["result"]).write_text(json.dumps(res))
    _shutdown(llm)


if __name__ == "__main__":
    import argparse
    import signal

    # a TERM (session.sh draft's own time limit) unwinds through reference()'s `finally`
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["reference", "accept"])
    parser.add_argument("config", type=Path, help="the step's JSON config, written by bench/draft_quality.py")
    a = parser.parse_args()
    {"reference": reference, "accept": accept}[a.step](json.loads(a.config.read_text()))
