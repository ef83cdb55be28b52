"""The client's cost of storing one sample, per GB, with the corpus checksum it records
(XXH3-128, client/corpus/store.py) against SHA-256 (what it recorded before 2026-12-02), in one
process: the checksum alone, and the whole store step (write to a temporary name, fsync,
rename, checksum: `store.write_files_atomic`) as the client runs it, then the same write
with SHA-256 computed instead.

    python bench/checksum.py                              # 32 and 67 MB samples in /dev/shm
    python bench/checksum.py --mb 67 --dir /data/tmp --out r.json

32 MB is a 2048-token sample of the `--h200` preset (4 layers x 2048 hidden, bf16), 67 MB
one of the Llama-3.1-8B shape (4 x 4096). CPU seconds (getrusage, this process) per GB
stored; the cheaper of `--repeat` runs counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from hsx_tools.bench.common import hardware
from hsx_client.corpus import store


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _per_gb(fn, nbytes: int, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        c = _cpu()
        for i in range(n):
            fn(i)
        best = min(best, (_cpu() - c) / (n * nbytes / 1e9))
    return round(best, 4)


def measure(mb: int, root: Path, n: int, repeat: int) -> dict:
    data = np.random.default_rng(0).integers(0, 1 << 16, size=(mb << 20) // 2, dtype=np.uint16).data
    nbytes = data.nbytes
    row: dict = {"sample_mb": mb}
    for algo in ("xxh3_128", "sha256"):
        row[f"{algo}_cpu_s_per_gb"] = _per_gb(lambda i, a=algo: store.file_digest(data, a), nbytes, n, repeat)

    def write_now(i: int) -> None:
        store.write_files_atomic(root, {f"s{i}.bin": data})

    def write_sha256(i: int) -> None:  # the store step as it was: the same write, SHA-256 beside it
        write_now(i)
        store.file_digest(data, "sha256")

    # write_files_atomic now computes XXH3-128; the SHA-256 run adds SHA-256 on top of it,
    # so its figure is the old step plus an XXH3 pass (~0.04 s/GB): the ratio understates.
    row["store_cpu_s_per_gb"] = _per_gb(write_now, nbytes, n, repeat)
    row["store_with_sha256_cpu_s_per_gb"] = _per_gb(write_sha256, nbytes, n, repeat)
    row["checksum_ratio"] = round(row["sha256_cpu_s_per_gb"] / row["xxh3_128_cpu_s_per_gb"], 2)
    row["store_ratio"] = round(row["store_with_sha256_cpu_s_per_gb"] / row["store_cpu_s_per_gb"], 2)
    for f in root.glob("s*.bin"):
        f.unlink()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", default="32,67", help="sample sizes, MiB [32,67]")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="where the samples are written [/dev/shm]")
    p.add_argument("--samples", type=int, default=8, help="samples per run [8]")
    p.add_argument("--repeat", type=int, default=3, help="runs; the cheapest counts [3]")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hsx-checksum-") as d:
        for mb in (int(x) for x in args.mb.split(",")):
            row = measure(mb, Path(d), args.samples, args.repeat)
            rows.append(row)
            print(f"{mb} MiB samples: checksum CPU s/GB xxh3_128 {row['xxh3_128_cpu_s_per_gb']:.3f}, sha256 "
                  f"{row['sha256_cpu_s_per_gb']:.3f} ({row['checksum_ratio']:.1f}x); store step "
                  f"{row['store_cpu_s_per_gb']:.3f} vs with SHA-256 {row['store_with_sha256_cpu_s_per_gb']:.3f} "
                  f"({row['store_ratio']:.2f}x)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": "checksum", "date": time.strftime("%Y-%m-%d"),
                                              "dir": args.dir, "hardware": hardware(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
