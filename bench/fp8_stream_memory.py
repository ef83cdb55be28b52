"""The client's peak memory storing one long sample (issue 36.8), per corpus dtype and path,
with no server: a synthetic sample of `--tokens` x 4 layers x `--hidden` bf16 states (random,
made chunk by chunk so the source never holds it) goes into a speculators corpus file

    stream  hsx_client.corpus.stream_write.store_stream, in chunks of `--chunk-mib` (what
            `hsx extract` does for every format since issue 36: fp8 included)
    whole   the body whole, decoded and encoded at once (`encode_sample`, write_files_atomic):
            what `hsx extract --dtype fp8` did before issue 36

Each arm runs in a process of its own; it reports its peak RSS (VmHWM) over its RSS after
the imports, and the bytes it wrote.

    python bench/fp8_stream_memory.py                      # 16K tokens x 4 x 4096 (512 MiB)
    python bench/fp8_stream_memory.py --tokens 4096 --arms fp8-stream,fp8-whole --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("fp8-stream", "fp8-whole", "bf16-stream", "bf16-whole")
LAYER_IDS = [1, 2, 3, 4]
VOCAB = 32000


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class SyntheticStream:
    """A SampleStream of `tokens` rows made chunk by chunk into one reused buffer (the
    transport's chunk buffer: read-only views, valid until the next chunk)."""

    def __init__(self, tokens: int, hidden: int, chunk_bytes: int) -> None:
        import numpy as np
        import torch

        from hsx_client.sample_stream import StatesLayout

        self.tokens, self.hidden = tokens, hidden
        self.layout_ = StatesLayout(torch.bfloat16, (tokens, len(LAYER_IDS), hidden),
                                    {"layer_ids": json.dumps(LAYER_IDS)})
        self.rows = max(1, chunk_bytes // self.layout_.row_bytes)
        self.buf = torch.empty(self.rows, len(LAYER_IDS), hidden, dtype=torch.bfloat16)
        self.gen = torch.Generator().manual_seed(0)
        self.ids = np.random.default_rng(0).integers(0, VOCAB, tokens).astype(np.int64)

    def fill(self, n: int):
        """The next n rows' states (a view of the reused buffer)."""
        import torch

        out = self.buf[:n]
        torch.randn(out.shape, generator=self.gen, out=out)  # bf16 randn: no float32 copy of the chunk
        return out

    async def layout(self):
        return self.layout_

    async def head(self):
        import numpy as np

        from hsx_client.sample_stream import SampleHead

        return SampleHead(self.ids, np.ones(self.tokens, np.uint8), self.layout_.metadata, self.layout_.dtype,
                          self.layout_.shape)

    async def chunks(self):
        import torch

        from hsx_client.sample_stream import StatesChunk

        for start in range(0, self.tokens, self.rows):
            stop = min(self.tokens, start + self.rows)
            rows = self.fill(stop - start)
            yield StatesChunk(start, stop, memoryview(rows.view(torch.uint8).reshape(-1).numpy()).toreadonly())


def _ctx(hidden: int):
    from hsx_client.corpus.formats import CorpusContext

    return CorpusContext(layer_ids=LAYER_IDS, hidden_size=hidden, dtype="bfloat16", final_norm=None,
                         draft_vocab_size=None, vocab_size=VOCAB)


def _whole_body(src: SyntheticStream) -> bytearray:
    """The sample's wire body (hsx/wire.py) as the whole path received it, filled in place."""
    import numpy as np
    import torch

    from hsx import wire

    t, n_layers, h = src.layout_.shape
    specs = [wire.TensorSpec("hidden_states", "BF16", (t, n_layers, h)), wire.TensorSpec("token_ids", "I64", (t,)),
             wire.TensorSpec("loss_mask", "U8", (t,))]
    head = wire.encode_header(specs, src.layout_.metadata)
    body = bytearray(len(head) + src.layout_.nbytes + 9 * t)
    body[: len(head)] = head
    at = len(head)
    for start in range(0, t, src.rows):
        rows = src.fill(min(t, start + src.rows) - start)
        raw = rows.view(torch.uint8).reshape(-1).numpy()
        body[at : at + raw.nbytes] = raw.data
        at += raw.nbytes
    body[at : at + 8 * t] = src.ids.tobytes()
    body[at + 8 * t :] = np.ones(t, np.uint8).tobytes()
    return body


def run_arm(arm: str, tokens: int, hidden: int, chunk_bytes: int, out: Path) -> dict:
    """One arm in this process: peak RSS over the RSS after the imports."""
    import torch  # noqa: F401  (imports first: not the arm's growth)

    from hsx import wire
    from hsx_client.corpus import store
    from hsx_client.corpus.formats import get_format
    from hsx_client.corpus.stream_write import store_stream

    dtype, path = arm.split("-")
    fmt = get_format("speculators", **({"dtype": "fp8"} if dtype == "fp8" else {}))
    ctx = _ctx(hidden)
    src = SyntheticStream(tokens, hidden, chunk_bytes)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    base = _status("VmRSS:")
    t0 = time.perf_counter()
    if path == "stream":
        async def blocking(fn, *args):
            return fn(*args)

        stored = asyncio.run(store_stream(out, fmt, 0, src, ctx, blocking))
        files = stored.files
    else:
        body = _whole_body(src)
        encoded = fmt.encode_sample(0, wire.decode(body), ctx)
        files = store.write_files_atomic(out, encoded.files)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM:")
    return {"arm": arm, "tokens": tokens, "hidden": hidden, "sample_mib": tokens * 4 * hidden * 2 / 2**20,
            "chunk_mib": chunk_bytes / 2**20, "base_mib": base / 2**20, "peak_mib": peak / 2**20,
            "growth_mib": (peak - base) / 2**20, "written_mib": sum(f["size"] for f in files.values()) / 2**20,
            "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="the stream's chunk (the client's default: 4)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--dir", default=None, help="where the corpus files go (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # a child: run this arm here
    args = ap.parse_args(argv)
    chunk = int(args.chunk_mib * 2**20)
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.tokens, args.hidden, chunk, Path(args.dir))))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {bad}: choose from {', '.join(ARMS)}")
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for arm in arms:
            cmd = [sys.executable, __file__, "--arm", arm, "--tokens", str(args.tokens), "--hidden",
                   str(args.hidden), "--chunk-mib", str(args.chunk_mib), "--dir", os.path.join(tmp, arm)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for x in results:
            print(f"{x['arm']:12s} sample {x['sample_mib']:.0f} MiB, chunks of {x['chunk_mib']:g} MiB: peak RSS "
                  f"{x['peak_mib']:.0f} MiB, +{x['growth_mib']:.0f} MiB over the imports; wrote "
                  f"{x['written_mib']:.0f} MiB in {x['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
