"""The codec study (`hsx bench --codec-only`, `python bench/codec.py`): response codecs
measured on real activations (hidden states of real text returned by `hsx serve`) for
ratio and MB/s per core, compress and decompress, with bit-exact round trips; see
bench/README.md for the candidates and the rule that picks one."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hsx.sizes import fmt_bytes
from hsx_tools.bench.common import (
    REPO, child_env, ensure_model, ensure_packages, hardware, log, model_facts, versions_light,
)
from hsx.layers import default_layers
from hsx_tools.server_process import ServerProcess

CODEC_CHUNK = 4 << 20  # bytes per frame, as the service compresses (hsx_service.body.response.CHUNK)


def _bf16_split_exp(u16):
    """bf16 -> (exponent plane, sign+mantissa plane), one byte each per value."""
    import numpy as np

    exp = (u16 >> 7).astype(np.uint8)  # drops the sign (bit 15 -> bit 8, cut by the uint8 cast)
    sm = ((u16 >> 8) & 0x80).astype(np.uint8)
    sm |= (u16 & 0x7F).astype(np.uint8)
    return exp, sm


def _bf16_join_exp(exp, sm):
    import numpy as np

    u16 = (sm & 0x80).astype(np.uint16) << 8
    u16 |= exp.astype(np.uint16) << 7
    u16 |= (sm & 0x7F).astype(np.uint16)
    return u16


def codec_candidates() -> list[dict[str, Any]]:
    import numpy as np
    import zstandard as zstd

    out: list[dict[str, Any]] = [{
        "name": "none (copy)", "threads": 1,
        "c": lambda b: bytes(b), "d": lambda b: b,
    }]
    for level in (-1, 1, 3):
        c1 = zstd.ZstdCompressor(level=level)
        d = zstd.ZstdDecompressor()
        out.append({"name": f"zstd {level}", "threads": 1, "c": c1.compress, "d": d.decompress})
        p2 = zstd.ZstdCompressionParameters.from_level(level, threads=2, job_size=1 << 20)
        c2 = zstd.ZstdCompressor(compression_params=p2)
        out.append({"name": f"zstd {level} threads=2", "threads": 2, "c": c2.compress, "d": d.decompress})

    def exp_codec(hash_log: int) -> tuple[Any, Any]:
        params = zstd.ZstdCompressionParameters.from_level(1, hash_log=hash_log, min_match=7)
        local = threading.local()  # zstd contexts are not thread-safe: one per thread

        def ctx() -> Any:
            if not hasattr(local, "c"):
                local.c = zstd.ZstdCompressor(compression_params=params)
                local.d = zstd.ZstdDecompressor()
            return local

        def c(b: memoryview) -> bytes:
            u16 = np.frombuffer(b, dtype=np.uint16)
            exp, sm = _bf16_split_exp(u16)
            z = ctx().c.compress(exp.data)
            return len(z).to_bytes(8, "little") + z + sm.tobytes()

        def d(blob: bytes) -> bytes:
            n = int.from_bytes(blob[:8], "little")
            exp = np.frombuffer(ctx().d.decompress(blob[8 : 8 + n]), dtype=np.uint8)
            sm = np.frombuffer(blob, dtype=np.uint8, offset=8 + n)
            return _bf16_join_exp(exp, sm).tobytes()

        return c, d

    for hl in (6, 8):
        c, d = exp_codec(hl)
        out.append({"name": f"bf16 exp-plane zstd1 hl{hl}", "threads": 1, "c": c, "d": d, "bf16": True})
    c, d = exp_codec(6)
    out.append({"name": "bf16 exp-plane hl6 x2 chunks", "threads": 2, "c": c, "d": d, "bf16": True, "pool": 2})

    # the cheaper split: high byte (sign + 7 exponent bits) coded, low byte raw
    params = zstd.ZstdCompressionParameters.from_level(1, hash_log=6, min_match=7)
    comp_hi = zstd.ZstdCompressor(compression_params=params)
    dec_hi = zstd.ZstdDecompressor()

    def c_hi(b: memoryview) -> bytes:
        u8 = np.frombuffer(b, dtype=np.uint8).reshape(-1, 2)
        z = comp_hi.compress(np.ascontiguousarray(u8[:, 1]).data)
        return len(z).to_bytes(8, "little") + z + np.ascontiguousarray(u8[:, 0]).tobytes()

    def d_hi(blob: bytes) -> bytes:
        n = int.from_bytes(blob[:8], "little")
        hi = np.frombuffer(dec_hi.decompress(blob[8 : 8 + n]), dtype=np.uint8)
        lo = np.frombuffer(blob, dtype=np.uint8, offset=8 + n)
        out_ = np.empty((hi.shape[0], 2), dtype=np.uint8)
        out_[:, 0], out_[:, 1] = lo, hi
        return out_.tobytes()

    out.append({"name": "bf16 high-byte zstd1 hl6", "threads": 1, "c": c_hi, "d": d_hi, "bf16": True})
    return out


def measure_codecs(data: bytes, *, dtype: str = "bfloat16", repeat: int = 2, label: str = "") -> list[dict[str, Any]]:
    """Every candidate on `data` cut in 4 MiB chunks: ratio, MB/s wall and per CPU
    second (process time, so 2 threads on 2 cores count twice), bit-exact check."""
    from concurrent.futures import ThreadPoolExecutor

    view = memoryview(data)
    chunks = [view[i : i + CODEC_CHUNK] for i in range(0, len(view), CODEC_CHUNK)]
    rows = []
    for cand in codec_candidates():
        if cand.get("bf16") and dtype != "bfloat16":
            continue
        pool = ThreadPoolExecutor(cand["pool"]) if cand.get("pool") else None
        mapper = pool.map if pool else map
        best_c = best_d = None
        blobs: list[bytes] = []
        for _ in range(repeat):
            w, c = time.perf_counter(), time.process_time()
            blobs = list(mapper(cand["c"], chunks))
            tw, tc = time.perf_counter() - w, time.process_time() - c
            if best_c is None or tw < best_c[0]:
                best_c = (tw, tc)
            w, c = time.perf_counter(), time.process_time()
            back = list(mapper(cand["d"], blobs))
            tw, tc = time.perf_counter() - w, time.process_time() - c
            if best_d is None or tw < best_d[0]:
                best_d = (tw, tc)
        exact = all(bytes(b) == bytes(ch) for b, ch in zip(back, chunks))
        if pool:
            pool.shutdown()
        comp = sum(len(b) for b in blobs)
        mb = len(data) / 1e6
        rows.append({
            "data": label, "codec": cand["name"], "threads": cand["threads"], "ratio": len(data) / comp,
            "compress_MBps": mb / best_c[0], "compress_MBps_per_core": mb / max(best_c[1], 1e-9),
            "decompress_MBps": mb / best_d[0], "decompress_MBps_per_core": mb / max(best_d[1], 1e-9),
            "bit_exact": exact, "bytes": len(data),
        })
    return rows


def entropy_bound(data: bytes) -> dict[str, float]:
    """Order-0 entropy of the bf16 exponent byte: the best ratio of the plane split."""
    import numpy as np

    u16 = np.frombuffer(data, dtype=np.uint16)
    exp, _ = _bf16_split_exp(u16)
    counts = np.bincount(exp, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    h = float(-(p * np.log2(p)).sum())
    return {"exponent_bits": h, "ratio_limit": 16.0 / (8.0 + h)}


def format_codec_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'data':<22}{'codec':<30}{'ratio':>7}{'comp MB/s':>11}{'/core':>8}{'dec MB/s':>10}{'/core':>8}  exact"]
    for r in rows:
        lines.append(
            f"{r['data'][:21]:<22}{r['codec']:<30}{r['ratio']:>7.3f}{r['compress_MBps']:>11.0f}"
            f"{r['compress_MBps_per_core']:>8.0f}{r['decompress_MBps']:>10.0f}{r['decompress_MBps_per_core']:>8.0f}  "
            f"{'yes' if r['bit_exact'] else 'NO'}"
        )
    return "\n".join(lines)


def choose_codec(rows: list[dict[str, Any]], *, target_MBps_per_core: float = 400.0) -> dict[str, Any]:
    """The pick the figures make: the best mean ratio among bit-exact codecs whose slowest
    compress speed per core (over all data sets) is at least `target_MBps_per_core`
    (below that, compression costs more cores than a server spares for states at GPU
    rates: ~4 GB/s for one H200 running the 16 x 2048 model)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["codec"], []).append(r)
    scored = []
    for name, rs in by.items():
        if not all(r["bit_exact"] for r in rs):
            continue
        scored.append({
            "codec": name,
            "mean_ratio": sum(r["ratio"] for r in rs) / len(rs),
            "min_compress_MBps_per_core": min(r["compress_MBps_per_core"] for r in rs),
            "min_decompress_MBps_per_core": min(r["decompress_MBps_per_core"] for r in rs),
        })
    fast = [s for s in scored if s["min_compress_MBps_per_core"] >= target_MBps_per_core and s["codec"] != "none (copy)"]
    pick = max(fast, key=lambda s: s["mean_ratio"]) if fast else None
    return {"rule": f"best mean ratio with compress >= {target_MBps_per_core:.0f} MB/s per core", "pick": pick,
            "candidates": sorted(scored, key=lambda s: -s["mean_ratio"])}


def measure_corpus_codecs(corpus: Path, files: int, max_bytes: int = 256 << 20) -> dict[str, Any]:
    """The codecs on the states of a speculators corpus (e.g. (c)'s)."""
    from safetensors import safe_open

    bufs, total = [], 0
    dtype = "bfloat16"
    for p in sorted((Path(corpus) / "hidden_states").glob("hs_*.safetensors"))[:files]:
        with safe_open(str(p), framework="pt") as f:
            t = f.get_tensor("hidden_states")
        dtype = str(t.dtype).removeprefix("torch.")
        import torch

        b = t.contiguous().view(torch.uint8).numpy().tobytes()
        bufs.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = b"".join(bufs)
    log(f"codecs on {fmt_bytes(len(data))} of {corpus} ({dtype}) ...")
    rows = measure_codecs(data, dtype=dtype, repeat=1, label="corpus (c)")
    print(format_codec_table(rows), flush=True)
    return {"rows": rows, "entropy": entropy_bound(data) if dtype == "bfloat16" else None,
            "choice": choose_codec(rows)}


def _text_prompts(limit: int) -> list[str]:
    """Real text: the shared OASST fixture when present, else the tiny model's text."""
    fixture = REPO.parent / "shared" / "fixtures" / "chat" / "oasst" / "threads.messages.jsonl"
    out: list[str] = []
    seen: set[str] = set()
    if fixture.exists():
        for line in fixture.read_text().splitlines():
            try:
                msgs = json.loads(line)["messages"]
            except (ValueError, KeyError):
                continue
            text = "\n".join(str(m.get("content") or "") for m in msgs)
            # threads of one conversation tree share their opening turns, whose states are
            # then byte-identical: keep one thread per opening, or zstd finds long repeats
            # that a real corpus does not have
            head = text[:200]
            if text.strip() and head not in seen:
                seen.add(head)
                out.append(text)
            if len(out) >= limit:
                break
    if not out:
        from hsx_tools.tiny_model import _TEXT

        words = _TEXT.split()
        out = [" ".join(words[i:] + words[:i]) for i in range(0, min(limit, len(words)))]
    return out


def collect_states(model: str, engine_flags: list[str], prompts: list[str], max_len: int, workdir: Path,
                   timeout: float) -> tuple[bytes, str]:
    """States of real text from a real `hsx serve` (all its layers, raw bytes)."""
    import httpx

    server = ServerProcess(model, *engine_flags, log_path=workdir / f"server-codec-{Path(model).name}.log",
                           env=child_env())
    try:
        server.wait_ready(timeout)
        from hsx import wire

        bufs, dtype = [], "bfloat16"
        with httpx.Client(timeout=600) as client:
            for text in prompts:
                r = client.post(server.url + "/hidden_states",
                                json={"prompt": text, "max_length": max_len, "truncation": "right"},
                                headers={"Accept-Encoding": "identity"})
                r.raise_for_status()
                d = wire.decode(r.content)
                hs = d.hidden_states
                dtype = str(hs.dtype).removeprefix("torch.")
                import torch

                bufs.append(hs.contiguous().view(torch.uint8).numpy().tobytes())
        return b"".join(bufs), dtype
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hsx bench --codec-only",
        description="Measure response codecs on real activations (hidden states of real text returned by "
        "hsx serve): ratio, MB/s and MB/s per core of compress/decompress, bit-exact round trips.",
    )
    p.add_argument("--model", action="append", default=[],
                   help="model dir to serve (repeatable; default: shared stories260K + a tiny random Llama)")
    p.add_argument("--make-model", default="layers=6,hidden=256,ffn=512,heads=4,kv_heads=2,vocab=1024,dtype=bfloat16",
                   help="the random model built when no --model is given")
    p.add_argument("--corpus", help="measure on the states of an existing speculators corpus instead")
    p.add_argument("--texts", type=int, default=64, help="text prompts per model [64]")
    p.add_argument("--max-len", type=int, default=480, help="tokens per prompt at most [480]")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per codec, best kept [3]")
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine flag for the servers")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--workdir")
    p.add_argument("--start-timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    own = not a.workdir
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="hsx-codec-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ensure_packages(workdir)
    try:
        rows: list[dict[str, Any]] = []
        entropy: dict[str, Any] = {}
        if a.corpus:
            res = measure_corpus_codecs(Path(a.corpus), 10**9, max_bytes=512 << 20)
            rows, entropy = res["rows"], {"corpus": res["entropy"]}
        else:
            models = list(a.model)
            if not models:
                stories = REPO.parent / "shared" / "fixtures" / "models" / "stories260K"
                if stories.exists():
                    models.append(str(stories))
                models.append(str(ensure_model(a.make_model, workdir, a.max_len)))
            texts = _text_prompts(a.texts)
            for model in models:
                facts = model_facts(Path(model))
                n = facts["num_hidden_layers"]
                flags = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(a.max_len + 16), "--layers",
                         ",".join(map(str, default_layers(n))), "--zstd-level", "1",
                         *[x for f in a.engine_arg for x in shlex.split(f)]]
                label = f"{Path(model).name[:12]} {n}x{facts['hidden_size']}"
                log(f"codec: states of {len(texts)} texts from {model} ...")
                data, dtype = collect_states(model, flags, texts, a.max_len, workdir, a.start_timeout)
                log(f"codec: {fmt_bytes(len(data))} of {dtype} states; measuring ...")
                rows += measure_codecs(data, dtype=dtype, repeat=a.repeat, label=label)
                if dtype == "bfloat16":
                    entropy[label] = entropy_bound(data)
        print("\n" + format_codec_table(rows), flush=True)
        for label, e in entropy.items():
            if e:
                print(f"{label}: exponent entropy {e['exponent_bits']:.2f} bits -> plane-split limit "
                      f"{e['ratio_limit']:.3f}x", flush=True)
        choice = choose_codec(rows)
        pick = choice["pick"]
        print(f"\nrule: {choice['rule']}", flush=True)
        print(f"pick: {pick['codec'] if pick else 'none qualifies'}"
              + (f" (mean ratio {pick['mean_ratio']:.3f}, >= {pick['min_compress_MBps_per_core']:.0f} MB/s/core "
                 f"compress, >= {pick['min_decompress_MBps_per_core']:.0f} decompress)" if pick else ""), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps({
                "hsx_codec_bench": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hardware": hardware(),
                "versions": versions_light(), "chunk_bytes": CODEC_CHUNK, "rows": rows, "entropy": entropy,
                "choice": choice,
            }, indent=2))
            log(f"wrote {a.out}")
        return 0
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)

