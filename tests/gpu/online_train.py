"""Online vs offline speculators training on one GPU (run by hand on the lent H200).

One `hsx serve` takes part of the GPU (`--gpu-memory-utilization`); speculators' trainer
(EAGLE-3 draft, `python -m hsx_client.training.speculators_train`) takes the rest. The same
training runs three ways on the same rows, one after the other:
  online   `--states none` token table + `--hidden-states-backend hsx` (states fetched from
           the server while training; same-host leases)
  offline  the full bf16 corpus (`hsx extract`), speculators' `file` backend
  fp8      the `--dtype fp8` corpus, speculators' `fp8` backend (with --runs ...,fp8)
and prints samples/s and tokens/s of each: steady state, from the end of the first step
to the end of the last one the trainer asked a batch after (the DataLoader wrapped in a
counter; nothing else touched), plus the time each corpus took to write and its size.
Seen working end to end on CPU (2026-12-01, a random 6 x 256 Llama, 40 rows, 4 steps,
`--train-arg=--draft-attn-impl=sdpa --train-arg=--loss-implementation=eager`).

    python tests/gpu/online_train.py --workdir /tmp/hot --out $OUT/online.json [--runs online,offline,fp8] [--torchrun]

Needs, beyond the vLLM kit (shared/gpu-kit/README.md) and the machine's image: the wheels
`bash tests/gpu/online_wheels.sh` downloads into .whl/online (speculators, hs-connectors,
datasets, multiprocess, loguru), installed there with
`pip install --no-deps --target /tmp/site2 .whl/online/*.whl`, then `. tests/gpu/kit/env.sh` (the kit, and
client/, service/, tools/ linked under their package names) and PYTHONPATH=$PYTHONPATH:/tmp/site2.
datasets 5.1 wants pyarrow >= 24 and fsspec <= 2026.7.0: check the image's with `pip show`.

The model is a random Llama 16 x 2048 (bench's --h200 shape, vocab 32000, bf16); the rows
are random token ids (pre-tokenized, the first quarter context, the rest supervised), so
nothing but the working tree is needed. `--model DIR` / `--input FILE` take real ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
H200_MODEL = "layers=16,hidden=2048,ffn=8192,heads=16,kv_heads=8,vocab=32000,dtype=bfloat16,max_pos=4096"


# ----------------------------------------------------------------------------- the timed trainer (child)


class TimedLoader:
    """The trainer's DataLoader, counting rows and tokens per batch and when each step ends."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.done: list[tuple[float, int, int]] = []  # (time step k ended, rows of batch k, tokens of batch k)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            doc = batch["document_ids"]
            rows, tokens = int(doc.max()) + 1, int((doc != -1).sum())
            yield batch
            self.done.append((time.perf_counter(), rows, tokens))  # the trainer asks again: step done

    def summary(self) -> dict:
        d = self.done
        if len(d) < 2:
            return {"steps": len(d), "error": "fewer than 2 steps timed"}
        seconds = d[-1][0] - d[0][0]
        rows, tokens = sum(r for _, r, _ in d[1:]), sum(t for _, _, t in d[1:])
        return {"steps": len(d), "timed_steps": len(d) - 1, "seconds": seconds, "rows": rows, "tokens": tokens,
                "samples_per_s": rows / seconds, "tokens_per_s": tokens / seconds}


def timed_train(out: str, argv: list[str]) -> int:
    from hsx_client.training import speculators_backend  # noqa: F401 - registered before speculators' config

    import speculators.train.trainer as tr
    from hsx_client.training import speculators_train

    loaders: list[TimedLoader] = []
    init = tr.Trainer.__init__

    def timed_init(self, model, config, train_loader, val_loader=None):
        loaders.append(TimedLoader(train_loader))
        init(self, model, config, loaders[-1], val_loader)

    tr.Trainer.__init__ = timed_init
    sys.path.insert(0, str(REPO / "tests"))
    from _cpu_trainer import patch_for_cpu  # a no-op with an accelerator: lets this run on CPU as a smoke test

    patch_for_cpu()
    t0 = time.perf_counter()
    rc = speculators_train.main(argv)
    res = loaders[0].summary() if loaders else {"error": "no trainer was built"}
    res.update(rc=rc, wall_s=time.perf_counter() - t0)
    Path(out).write_text(json.dumps(res))
    return rc


# ----------------------------------------------------------------------------- the driver


def _run(cmd: list[str], log: Path, env: dict | None = None) -> float:
    t = time.perf_counter()
    with open(log, "wb") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{log.read_text(errors='replace')[-4000:]}")
    return time.perf_counter() - t


def _rows(path: Path, n: int, seq: int, vocab: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            ids = rng.integers(16, vocab, size=seq).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (seq // 4) + [1] * (seq - seq // 4)}) + "\n")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="online vs offline speculators training on one GPU")
    p.add_argument("--workdir", default="/tmp/hsx-online")
    p.add_argument("--model", help=f"model dir (default: a random Llama {H200_MODEL})")
    p.add_argument("--input", help="JSONL rows (default: random pre-tokenized rows)")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per random row")
    p.add_argument("--layers", default="2,8,13,16")
    p.add_argument("--gpu-memory-utilization", default="0.45", help="the server's share of the GPU")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per training")
    p.add_argument("--total-seq-len", type=int, default=8192, help="tokens per packed batch")
    p.add_argument("--num-workers", type=int, default=12, help="DataLoader workers (one request in flight each)")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--runs", default="online,offline", help="which trainings, in order: online,offline,fp8")
    p.add_argument("--enforce-eager", action="store_true", help="the server without torch.compile / CUDA graphs")
    p.add_argument("--torchrun", action="store_true", help="launch each training with torchrun (1 process)")
    p.add_argument("--train-arg", action="append", default=[],
                   help="extra speculators train flag, e.g. --train-arg=--draft-attn-impl=sdpa (CPU smoke runs "
                        "also need --train-arg=--loss-implementation=eager)")
    p.add_argument("--out")
    a = p.parse_args(argv)

    from hsx_tools.bench.common import child_env, ensure_model, ensure_packages, hardware, log
    from hsx_tools.server_process import ServerProcess

    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ensure_packages(work)
    for mod in ("speculators", "hs_connectors", "datasets", "loguru", "vllm"):
        __import__(mod)  # fail here, not after the server started
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x)}
    model = Path(a.model) if a.model else ensure_model(H200_MODEL, work, a.seq_len)
    rows = Path(a.input) if a.input else work / f"rows-{a.samples}x{a.seq_len}.jsonl"
    if not a.input and not rows.exists():
        _rows(rows, a.samples, a.seq_len, json.loads((model / "config.json").read_text())["vocab_size"])
    layers = [int(x) for x in a.layers.split(",")]
    server = ServerProcess(str(model), "--gpu-memory-utilization", a.gpu_memory_utilization, "--layers", a.layers,
                           "--max-model-len", str(a.seq_len + 64), "--max-num-batched-tokens", "16384",
                           *(["--enforce-eager"] if a.enforce_eager else []), log_path=work / "serve.log", env=child_env())
    res: dict = {"hardware": hardware(), "model": str(model), "samples": a.samples, "seq_len": a.seq_len,
                 "gpu_memory_utilization": a.gpu_memory_utilization, "steps": a.steps, "num_workers": a.num_workers,
                 "total_seq_len": a.total_seq_len, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        server.wait_ready(1800)
        hsx = [sys.executable, "-m", "hsx_tools.cli", "extract", "--server", server.url, "--input", str(rows), "--quiet",
               "--format", "speculators", "--draft-vocab-size", str(a.draft_vocab_size)]
        kinds = {"online": (["--states", "none"], ["--hidden-states-backend", "hsx", "--hsx-servers", server.url]),
                 "offline": ([], []), "fp8": (["--dtype", "fp8"], ["--hidden-states-backend", "fp8"])}
        corpora = {k: kinds[k] for k in a.runs.split(",")}
        for name, (extract_args, _) in corpora.items():  # kept in the workdir: a rerun reuses them
            out = work / f"corpus-{name}"
            if not (out / "hsx_corpus.json").exists():
                log(f"writing the {name} corpus ...")
                res[f"extract_s_{name}"] = _run([*hsx, "--output", str(out), *extract_args], work / f"extract-{name}.log", env)
            res[f"disk_bytes_{name}"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        for name, (_, backend) in corpora.items():
            log(f"training ({name}) ...")
            timing = work / f"train-{name}.json"
            train = ["--verifier-name-or-path", str(model), "--data-path", str(work / f"corpus-{name}"),
                     "--save-path", str(work / f"ckpt-{name}"), "--no-resume-from-checkpoint", *backend,
                     "--on-missing", "raise", "--total-seq-len", str(a.total_seq_len), "--num-workers",
                     str(a.num_workers), "--epochs", "1", "--max-steps", str(a.steps), "--train-data-ratio", "0.95",
                     "--draft-vocab-size", str(a.draft_vocab_size), "--target-layer-ids", *map(str, layers[:3]),
                     "--logger", "", "--log-freq", "50", *a.train_arg]
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] \
                if a.torchrun else [sys.executable]
            _run([*launch, __file__, "--timed-train", str(timing), "--", *train], work / f"train-{name}.log", env)
            res[f"train_{name}"] = json.loads(timing.read_text())
    finally:
        server.stop()
    print()
    for name in ("online", "offline", "fp8"):
        t = res.get(f"train_{name}")
        if t:
            print(f"{name:8s} {t.get('samples_per_s', 0):8.1f} samples/s {t.get('tokens_per_s', 0):10.0f} tokens/s "
                  f"({t.get('timed_steps')} steps), corpus {res[f'disk_bytes_{name}'] / 2**30:.2f} GiB"
                  + (f" written in {res[f'extract_s_{name}']:.0f} s" if f"extract_s_{name}" in res else ""))
    on, off = (res.get(f"train_{k}", {}).get("samples_per_s") for k in ("online", "offline"))
    if on and off:
        print(f"online / offline samples/s = {on / off:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--timed-train":
        sys.exit(timed_train(sys.argv[2], sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:]))
    sys.exit(main(sys.argv[1:]))
