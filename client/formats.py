"""Corpus format writers: one decoded response -> the files a trainer reads.

Two formats (see shared/DESIGN.md, "Corpus formats"):

speculators 0.9 (`speculators train --data-path DIR --on-missing raise`)
    hidden_states/hs_{i}.safetensors  {"hidden_states": [T, 4, H] model dtype (ascending
                                      layer ids, last slice pre-norm), "token_ids": int64 [T]}
    data-*.arrow, dataset_info.json, state.json  the `datasets` table (`save_to_disk` after
                                      `set_format("torch")`): input_ids int64, loss_mask int64 0/1,
                                      seq_len; row i <-> hs_i (speculators' reader is positional
                                      and drops a row whose token_ids differ from input_ids)
    token_freq.pt, d2t-{K}.npy, t2d-{K}.npy    vocab mapping (client/vocab.py)
    hsx_format.json                   format facts (mask policy, counts, compaction)

    Variants (`hsx extract --states none` / `--dtype fp8`): client/speculators_variants.py.

SpecForge 0.2 (offline; `--hidden-states-path DIR --vocab-mapping DIR/vocab_mapping/vocab_mapping.pt`)
    rows/{i // 1000:04d}/data_{i}.ckpt  torch.save {"input_ids": int64 [T], "loss_mask": int64 [T],
                                      "aux_hidden_state": [1, T, 3H] (three aux layers concatenated
                                      ascending), "hidden_state": [1, T, H] (last layer after the
                                      final norm)}; 1000 files per directory
    vocab_mapping/vocab_mapping.pt    {"d2t": int64 [K], "t2d": bool [V]}
    hsx_format.json

Both readers walk or index the corpus directory themselves: the store's temporary names
must not end in `.ckpt` (SpecForge lists every `*.ckpt` under the directory) and must not be
`hs_{n}.safetensors`.

The sample record (kept in the manifest, given back to `finalize` / `verify_sample`):
    num_tokens, num_supervised, mask_runs (loss mask as run lengths, starting with a run of
    0s that may be empty), ids_crc32 (zlib.crc32 of the int64 token ids), hidden_size,
    num_layers, dtype, mask_source ("server" or "none": no mask came back, every token
    supervised).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from hsx import wire

from .postnorm import FinalNorm, apply_final_norm
from .vocab import count_supervised, specforge_vocab_files, speculators_vocab_files

if TYPE_CHECKING:
    from hsx.wire import Decoded

FORMAT_FILE = "hsx_format.json"
COMPACTION_JOURNAL = "hsx_compaction.json"
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class CorpusContext:
    """Facts from the server's /info (and the run) that every sample shares."""

    layer_ids: list[int]
    hidden_size: int
    dtype: str
    final_norm: FinalNorm | None  # required by specforge
    draft_vocab_size: int | None
    vocab_size: int | None  # None: not reported (then no draft vocab mapping can be built)
    mask_policy: str | None = None  # recorded in hsx_format.json ("per_turn" | "all_turns")


@dataclass
class SampleOutput:
    """Complete files of one sample (relative path -> bytes, or a list of buffers that
    make the file in order) and its manifest record."""

    files: dict[str, Any]
    record: dict = field(default_factory=dict)


class CorpusFormat(Protocol):
    name: str

    def encode_sample(self, index: int, decoded: Decoded, ctx: CorpusContext) -> SampleOutput: ...

    def finalize(self, out_dir: Path, records: list[tuple[int, dict]], ctx: CorpusContext) -> list[str]: ...

    def bytes_per_token(self, ctx: CorpusContext) -> float: ...

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]: ...


class CorpusFormatError(ValueError):
    """A response or a corpus that does not fit the format."""


# ----------------------------------------------------------------------------- helpers


def mask_to_runs(mask: np.ndarray) -> list[int]:
    """0/1 mask -> alternating run lengths, starting with the (maybe empty) run of 0s."""
    m = np.asarray(mask).reshape(-1).astype(bool)
    if m.size == 0:
        return []
    edges = np.flatnonzero(m[1:] != m[:-1]) + 1
    bounds = np.concatenate([[0], edges, [m.size]])
    runs = np.diff(bounds).tolist()
    return ([0] + runs) if m[0] else runs


def runs_to_mask(runs: list[int]) -> np.ndarray:
    """Inverse of `mask_to_runs` (int64 0/1)."""
    vals = np.arange(len(runs)) % 2
    return np.repeat(vals, runs).astype(np.int64)


def _ids_crc(ids: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(ids, dtype="<i8").tobytes())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """tmp + fsync + rename in the same directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _check_decoded(decoded: Decoded, ctx: CorpusContext) -> tuple[torch.Tensor, np.ndarray, np.ndarray, str]:
    hs = decoded.hidden_states
    if not isinstance(hs, torch.Tensor) or hs.ndim != 3:
        raise CorpusFormatError(f"hidden_states must be a [T, L, H] tensor, got {getattr(hs, 'shape', type(hs))}")
    t, n_layers, h = hs.shape
    if n_layers != 4 or len(ctx.layer_ids) != 4:
        raise CorpusFormatError(
            f"EAGLE-3 corpora need 4 layers (3 aux + last), got {n_layers} states for layer ids {ctx.layer_ids}"
        )
    if h != ctx.hidden_size:
        raise CorpusFormatError(f"hidden size {h} differs from the server's {ctx.hidden_size}")
    if ctx.dtype in _TORCH_DTYPES and hs.dtype != _TORCH_DTYPES[ctx.dtype]:
        raise CorpusFormatError(f"states are {hs.dtype}, the server said {ctx.dtype}")
    if "layer_ids" in decoded.metadata and decoded.layer_ids != list(ctx.layer_ids):
        raise CorpusFormatError(f"response layers {decoded.layer_ids} differ from the run's {ctx.layer_ids}")
    if t == 0:
        raise CorpusFormatError("response has no tokens")
    ids, mask, source = check_tokens(decoded, ctx, t)
    return hs, ids, mask, source


def check_tokens(decoded: Decoded, ctx: CorpusContext, t: int | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """A response's token ids (in the target vocab) and 0/1 loss mask (all ones when none
    came back), with its source; `t`: the number of states they must match."""
    ids = np.asarray(decoded.token_ids).astype(np.int64, copy=False).reshape(-1)
    t = ids.shape[0] if t is None else t
    if t == 0:
        raise CorpusFormatError("response has no tokens")
    if ids.shape[0] != t:
        raise CorpusFormatError(f"{ids.shape[0]} token ids for {t} states")
    if ctx.vocab_size is None:
        if ctx.draft_vocab_size:
            raise CorpusFormatError("a draft vocab mapping needs the target vocab size, which the server did not report")
        if (ids < 0).any():
            raise CorpusFormatError("negative token ids")
    elif (ids < 0).any() or (ids >= ctx.vocab_size).any():
        raise CorpusFormatError(f"token ids outside the target vocab of {ctx.vocab_size}")
    if decoded.loss_mask is None:
        mask, source = np.ones(t, dtype=np.int64), "none"
    else:
        mask = np.asarray(decoded.loss_mask).reshape(-1).astype(np.int64)
        if mask.shape[0] != t or ((mask != 0) & (mask != 1)).any():
            raise CorpusFormatError("loss_mask must be 0/1 with one entry per token")
        source = "server"
    return ids, mask, source


def _record(ids: np.ndarray, mask: np.ndarray, source: str, ctx: CorpusContext) -> dict:
    return {
        "num_tokens": int(ids.shape[0]),
        "num_supervised": int(mask.sum()),
        "mask_runs": mask_to_runs(mask),
        "ids_crc32": _ids_crc(ids),
        "hidden_size": int(ctx.hidden_size),
        "num_layers": len(ctx.layer_ids),
        "dtype": ctx.dtype,
        "mask_source": source,
    }


def _record_problems(record: dict, ids: np.ndarray) -> list[str]:
    out = []
    if ids.shape[0] != record.get("num_tokens"):
        out.append(f"{ids.shape[0]} tokens in the file, the record says {record.get('num_tokens')}")
    elif _ids_crc(ids) != record.get("ids_crc32"):
        out.append("token ids differ from the record (crc32 mismatch)")
    runs = record.get("mask_runs", [])
    if sum(runs) != record.get("num_tokens"):
        out.append(f"record's loss mask covers {sum(runs)} tokens, not {record.get('num_tokens')}")
    return out


def _format_json(name: str, ctx: CorpusContext, **extra: object) -> bytes:
    doc = {
        "format": name,
        "mask_policy": ctx.mask_policy,
        "layer_ids": list(ctx.layer_ids),
        "hidden_size": ctx.hidden_size,
        "dtype": ctx.dtype,
        "vocab_size": ctx.vocab_size,
        "draft_vocab_size": ctx.draft_vocab_size,
        **extra,
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _sorted_records(records: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    recs = sorted(records, key=lambda r: r[0])
    idx = [i for i, _ in recs]
    if len(set(idx)) != len(idx):
        raise CorpusFormatError("finalize got the same sample index twice")
    if idx and idx[0] < 0:
        raise CorpusFormatError(f"negative sample index {idx[0]}")
    if not recs:
        raise CorpusFormatError("finalize got no samples: nothing to write")
    return recs


# ----------------------------------------------------------------------------- speculators

_TABLE_BATCH = 1024  # rows per Arrow batch: 32-bit list offsets hold any 1024 rows


class SpeculatorsFormat:
    """speculators 0.9: positional hs_{i}.safetensors + a `datasets` table.

    Failed samples: speculators reads row i from hs_i, so the table cannot have holes.
    When `finalize` gets a subset of the planned indices (m samples), it compacts in place:
    each sample with index >= m is renamed into a hole below m (lowest tail -> lowest hole),
    so every file is either untouched or renamed once, and rows are 0..m-1. The moves
    are first written to `hsx_compaction.json` (atomically), then done with os.replace; a
    rerun after a crash recomputes the same plan from the same records, checks it against
    the journal and finishes it (a move whose source is gone and target present is done).
    The journal stays as the record of the renumbering: sample `old` now lives at `new`,
    so `verify_sample` must be given the new index for moved samples. The corpus is final
    after that: do not resume extraction into it.
    """

    name = "speculators"
    format_facts: dict = {}  # what a variant adds to hsx_format.json (speculators_variants.py)

    @staticmethod
    def hs_path(index: int) -> str:
        return f"hidden_states/hs_{int(index)}.safetensors"

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        item = _ITEMSIZE.get(ctx.dtype, 2)
        # states + token id in the hs file, input_ids + loss_mask (int64) in the table
        return len(ctx.layer_ids) * ctx.hidden_size * item + 8 + 16

    def encode_sample(self, index: int, decoded: Decoded, ctx: CorpusContext) -> SampleOutput:
        hs, ids, mask, source = _check_decoded(decoded, ctx)
        # The safetensors file is laid out here from the states' own bytes: one copy
        # (safetensors.torch.save made several and ran at ~0.3 GB/s on 34 MB samples).
        hs = hs.contiguous()
        ids = np.ascontiguousarray(ids, dtype="<i8")
        header = wire.encode_header(
            [wire.TensorSpec("hidden_states", wire.ST_DTYPES[str(hs.dtype).removeprefix("torch.")], tuple(hs.shape)),
             wire.TensorSpec("token_ids", "I64", tuple(ids.shape))],
            {"format": "hsx-speculators/1", "index": str(int(index)), "layer_ids": json.dumps(list(ctx.layer_ids))},
        )
        parts = [header, hs.view(torch.uint8).reshape(-1).numpy().data, ids.data]
        return SampleOutput({self.hs_path(index): parts}, _record(ids, mask, source, ctx))

    def prepare(self) -> None:
        try:
            import datasets  # noqa: F401  (finalize's table; ~1 s to import)
        except ImportError as exc:
            raise ImportError(f"the speculators format needs `datasets` for its table: {exc}") from exc

    def _read_ids(self, out_dir: Path, index: int) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(out_dir / self.hs_path(index)), framework="pt") as f:
            return f.get_tensor("token_ids").numpy()

    def _compact(self, out_dir: Path, indices: list[int]) -> list[tuple[int, int]]:
        m = len(indices)
        present = set(indices)
        holes = [i for i in range(m) if i not in present]
        tails = [i for i in indices if i >= m]
        moves = [(old, new) for old, new in zip(tails, holes)]
        journal = out_dir / COMPACTION_JOURNAL
        if journal.exists():
            recorded = [tuple(x) for x in json.loads(journal.read_text())["moves"]]
            if recorded != moves:
                raise CorpusFormatError(
                    f"{journal} records a different compaction than these {m} samples imply; "
                    f"the corpus was finalized from another set of samples"
                )
        elif moves:
            _write_atomic(journal, json.dumps({"num_samples": m, "moves": moves}).encode())
        for old, new in moves:
            src, dst = out_dir / self.hs_path(old), out_dir / self.hs_path(new)
            if src.exists():
                os.replace(src, dst)
            elif not dst.exists():
                raise CorpusFormatError(f"sample {old} has no file {src} (and {dst} is absent)")
        if moves:
            _fsync_dir((out_dir / self.hs_path(0)).parent)
        return moves

    def finalize(self, out_dir: Path, records: list[tuple[int, dict]], ctx: CorpusContext) -> list[str]:
        """Write the table (rows 0..m-1), vocab files and hsx_format.json; see the class doc."""
        import datasets
        from datasets.arrow_writer import ArrowWriter

        out_dir = Path(out_dir)
        recs = _sorted_records(records)
        indices = [i for i, _ in recs]
        moves = self._compact(out_dir, indices)
        # after compaction, hs_p holds the sample that had index p, or the one moved into p
        pos_of_old = dict(moves)
        rows = {pos_of_old.get(i, i): r for i, r in recs}
        if sorted(rows) != list(range(len(recs))):
            raise CorpusFormatError("compaction left holes")  # cannot happen; guards the plan

        tmp = out_dir / f".hsx_finalize.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        try:
            feats = datasets.Features({
                "input_ids": datasets.Sequence(datasets.Value("int64")),
                "loss_mask": datasets.Sequence(datasets.Value("int64")),
                "seq_len": datasets.Value("int64"),
            })
            freq = self._write_table(out_dir, rows, ctx, ArrowWriter(features=feats, path=str(tmp / "table.arrow")))
            ds = datasets.Dataset.from_file(str(tmp / "table.arrow"))
            ds.set_format("torch")
            ds.save_to_disk(str(tmp / "table"))
            del ds
            written = self._install_table(out_dir, tmp / "table")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

        extra = speculators_vocab_files(freq, ctx.draft_vocab_size, ctx.vocab_size)
        extra[FORMAT_FILE] = _format_json(
            self.name, ctx, **self.format_facts,
            num_samples=len(rows), num_tokens=sum(r["num_tokens"] for r in rows.values()),
            num_supervised=sum(r["num_supervised"] for r in rows.values()),
            compacted_moves=len(moves), compaction_journal=COMPACTION_JOURNAL if moves else None,
        )
        for rel, data in extra.items():
            _write_atomic(out_dir / rel, data)
        written += list(extra)
        if moves or (out_dir / COMPACTION_JOURNAL).exists():
            written.append(COMPACTION_JOURNAL)
        return written

    def _write_table(self, out_dir: Path, rows: dict[int, dict], ctx: CorpusContext, writer) -> Counter:
        """Rows 0..m-1 into `writer`, columnar in batches (per-row Python lists took
        ~1.4 ms a row at 2048 tokens, about a sixth of the time an H200 takes to make one).
        Token ids come back from each sample's file, so the table cannot disagree with
        it (speculators silently drops a row whose ids differ). Returns the counts of
        supervised tokens for the vocab files."""
        import pyarrow as pa

        freq: Counter = Counter()
        dense = np.zeros(int(ctx.vocab_size), dtype=np.int64) if ctx.vocab_size else None
        with writer as w:
            for start in range(0, len(rows), _TABLE_BATCH):
                ids_b, mask_b = [], []
                for p in range(start, min(len(rows), start + _TABLE_BATCH)):
                    ids = self._read_ids(out_dir, p).astype(np.int64, copy=False)
                    probs = _record_problems(rows[p], ids)
                    if probs:
                        raise CorpusFormatError(f"{self.hs_path(p)}: " + "; ".join(probs))
                    ids_b.append(ids)
                    mask_b.append(runs_to_mask(rows[p]["mask_runs"]))
                flat_ids, flat_mask = np.concatenate(ids_b), np.concatenate(mask_b)
                if dense is not None and (flat_ids.size == 0 or 0 <= flat_ids.min() and flat_ids.max() < dense.size):
                    dense += np.bincount(flat_ids[flat_mask.astype(bool)], minlength=dense.size)
                else:
                    count_supervised(freq, flat_ids, flat_mask)
                lens = np.array([len(x) for x in ids_b], dtype=np.int64)
                offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
                w.write_table(pa.table({
                    "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat_ids)),
                    "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(flat_mask)),
                    "seq_len": pa.array(lens),
                }))
            w.finalize()
        if dense is not None:
            nz = np.flatnonzero(dense)
            freq.update(dict(zip(nz.tolist(), dense[nz].tolist())))
        return freq

    @staticmethod
    def _install_table(out_dir: Path, table: Path) -> list[str]:
        """Move a save_to_disk directory's files into out_dir; state.json goes last.

        The old state.json is removed first, so a crash midway leaves a table that
        `load_from_disk` refuses (and a rerun of finalize rewrites), never a mixed one.
        """
        names = sorted(p.name for p in table.iterdir())
        if "state.json" not in names:
            raise CorpusFormatError("save_to_disk wrote no state.json")
        old_state = out_dir / "state.json"
        if old_state.exists():
            old_state.unlink()
            _fsync_dir(out_dir)
        for stale in out_dir.glob("data-*-of-*.arrow"):
            if stale.name not in names:
                stale.unlink()
        for n in [n for n in names if n != "state.json"] + ["state.json"]:
            with open(table / n, "rb") as f:
                os.fsync(f.fileno())
            os.replace(table / n, out_dir / n)
        _fsync_dir(out_dir)
        return names

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]:
        from safetensors import safe_open

        path = Path(out_dir) / self.hs_path(index)
        if not path.exists():
            return [f"{self.hs_path(index)} is missing"]
        probs = []
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                if not {"hidden_states", "token_ids"} <= keys:
                    return [f"{path.name} lacks {sorted({'hidden_states', 'token_ids'} - keys)}"]
                hs = f.get_slice("hidden_states")
                shape, dtype = list(hs.get_shape()), hs.get_dtype()
                ids_t = f.get_tensor("token_ids")
        except Exception as exc:  # unreadable header / truncated file
            return [f"{path.name} is unreadable: {type(exc).__name__}: {exc}"]
        want = [record.get("num_tokens"), record.get("num_layers", 4), record.get("hidden_size")]
        if shape != want:
            probs.append(f"hidden_states shape {shape}, expected {want}")
        want_dt = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(record.get("dtype"))
        if want_dt and dtype != want_dt:
            probs.append(f"hidden_states dtype {dtype}, expected {want_dt}")
        if ids_t.dtype != torch.int64 or ids_t.ndim != 1:
            probs.append(f"token_ids must be int64 [T], got {ids_t.dtype} {list(ids_t.shape)}")
        return probs + _record_problems(record, ids_t.numpy())


# ----------------------------------------------------------------------------- SpecForge


class SpecForgeFormat:
    """SpecForge 0.2 offline: one torch.save'd `.ckpt` per sample in a sharded tree.

    SpecForge lists every `*.ckpt` under the directory and has no positional index, so
    failed samples simply leave no file. `finalize` renames any `*.ckpt` under rows/ that
    no record accounts for (a file completed but never recorded before a crash) to
    `*.ckpt.orphan`, so the trainer cannot read unaccounted data, then writes
    vocab_mapping/vocab_mapping.pt and hsx_format.json (each tmp + fsync + rename).
    """

    name = "specforge"

    @staticmethod
    def ckpt_path(index: int) -> str:
        return f"rows/{int(index) // 1000:04d}/data_{int(index)}.ckpt"

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        item = _ITEMSIZE.get(ctx.dtype, 2)
        return 4 * ctx.hidden_size * item + 16

    def encode_sample(self, index: int, decoded: Decoded, ctx: CorpusContext) -> SampleOutput:
        if ctx.final_norm is None:
            raise CorpusFormatError("the specforge format needs the final norm (weights, eps) from the server")
        hs, ids, mask, source = _check_decoded(decoded, ctx)
        t, _, h = hs.shape
        # torch.cat / fresh tensors: torch.save must not drag a shared storage along.
        aux = torch.cat([hs[:, 0], hs[:, 1], hs[:, 2]], dim=-1).unsqueeze(0)
        last = apply_final_norm(hs[:, 3], ctx.final_norm).contiguous().unsqueeze(0)
        obj = {
            "input_ids": torch.from_numpy(ids.copy()),
            "loss_mask": torch.from_numpy(mask.copy()),
            "aux_hidden_state": aux,
            "hidden_state": last,
        }
        buf = io.BytesIO()
        torch.save(obj, buf)
        return SampleOutput({self.ckpt_path(index): buf.getvalue()}, _record(ids, mask, source, ctx))

    def _load(self, path: Path) -> dict:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)

    def finalize(self, out_dir: Path, records: list[tuple[int, dict]], ctx: CorpusContext) -> list[str]:
        """Quarantine unrecorded ckpt files, write the vocab mapping and hsx_format.json."""
        out_dir = Path(out_dir)
        recs = _sorted_records(records)
        expected = {self.ckpt_path(i) for i, _ in recs}
        orphans = 0
        rows_dir = out_dir / "rows"
        if rows_dir.exists():
            for p in sorted(rows_dir.rglob("*")):
                if p.is_file() and p.name.endswith((".ckpt", ".ckpt.gz")):
                    if p.relative_to(out_dir).as_posix() not in expected:
                        os.replace(p, p.with_name(p.name + ".orphan"))
                        orphans += 1
        freq: Counter = Counter()
        for i, rec in recs:
            raw = self._load(out_dir / self.ckpt_path(i))
            ids = raw["input_ids"].numpy()
            probs = _record_problems(rec, ids)
            if probs:
                raise CorpusFormatError(f"{self.ckpt_path(i)}: " + "; ".join(probs))
            count_supervised(freq, ids, runs_to_mask(rec["mask_runs"]))
        files = specforge_vocab_files(freq, ctx.draft_vocab_size, ctx.vocab_size)
        files[FORMAT_FILE] = _format_json(
            self.name, ctx, num_samples=len(recs), num_tokens=sum(r["num_tokens"] for _, r in recs),
            num_supervised=sum(r["num_supervised"] for _, r in recs), orphans_quarantined=orphans,
            hidden_state="final norm applied (" + (ctx.final_norm.style if ctx.final_norm else "?") + ")",
        )
        for rel, data in files.items():
            _write_atomic(out_dir / rel, data)
        return list(files)

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]:
        path = Path(out_dir) / self.ckpt_path(index)
        if not path.exists():
            return [f"{self.ckpt_path(index)} is missing"]
        try:
            raw = self._load(path)
        except Exception as exc:
            return [f"{path.name} is unreadable: {type(exc).__name__}: {exc}"]
        need = {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        if not isinstance(raw, dict) or not need <= set(raw):
            return [f"{path.name} lacks {sorted(need - set(raw if isinstance(raw, dict) else {}))}"]
        t, h = record.get("num_tokens"), record.get("hidden_size")
        n_aux = record.get("num_layers", 4) - 1
        want_dt = _TORCH_DTYPES.get(record.get("dtype"))
        probs = []
        for key, shape, dt in (("input_ids", [t], torch.int64), ("loss_mask", [t], torch.int64),
                               ("aux_hidden_state", [1, t, n_aux * h], want_dt),
                               ("hidden_state", [1, t, h], want_dt)):
            v = raw[key]
            if list(v.shape) != shape:
                probs.append(f"{key} shape {list(v.shape)}, expected {shape}")
            if dt is not None and v.dtype != dt:
                probs.append(f"{key} dtype {v.dtype}, expected {dt}")
        probs += _record_problems(record, raw["input_ids"].numpy())
        if not probs and not np.array_equal(raw["loss_mask"].numpy(), runs_to_mask(record["mask_runs"])):
            probs.append("loss_mask differs from the record")
        return probs


_FORMATS = {"speculators": SpeculatorsFormat, "specforge": SpecForgeFormat}


FORMAT_OPTIONS = {"states": "all", "dtype": "auto"}  # run settings that pick a variant, and their defaults


def format_options(settings: dict) -> dict:
    """The variant settings of a run that differ from the defaults (none: the plain format)."""
    return {k: settings[k] for k, d in FORMAT_OPTIONS.items() if settings.get(k) not in (None, d)}


def get_format(name: str, **options: str) -> CorpusFormat:
    """The writer for "speculators" or "specforge"; `states="none"` / `dtype="fp8"` pick
    speculators' token-table and fp8 variants (speculators_variants.py)."""
    if name not in _FORMATS:
        raise ValueError(f"unknown corpus format {name!r} (choose from {sorted(_FORMATS)})")
    if format_options(options):
        from .speculators_variants import variant_format

        return variant_format(name, **{**FORMAT_OPTIONS, **options})
    return _FORMATS[name]()
