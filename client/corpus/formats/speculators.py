"""speculators 0.9: positional `hidden_states/hs_{i}.safetensors` and a `datasets` table."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hsx import dtypes, wire
from hsx_client.corpus import store
from hsx_client.corpus.formats.common import (
    COMPACTION_JOURNAL, FORMAT_FILE, media_facts, CorpusContext, CorpusFormatError, Eagle3Format, SampleOutput, check_decoded, check_layout, check_tokens,
    format_json, make_record, record_problems, runs_to_mask, sorted_records, state_bytes_per_token,
)
from hsx_client.corpus.vocab import count_supervised, speculators_vocab_files

if TYPE_CHECKING:
    from hsx.wire import Decoded

_TABLE_BATCH = 1024  # rows per Arrow batch: 32-bit list offsets hold any 1024 rows


def sample_file_parts(ctx: CorpusContext, tensors: list[tuple[str, str, torch.Tensor | np.ndarray]]) -> list:
    """A sample's safetensors file as [header, buffers...] from the tensors' own bytes: one
    copy (safetensors.torch.save made several and ran at ~0.3 GB/s on 34 MB samples).
    `tensors`: (name, safetensors dtype code, tensor or array)."""
    specs, bufs = [], []
    for name, st_dtype, t in tensors:
        specs.append(wire.TensorSpec(name, st_dtype, tuple(t.shape)))
        if isinstance(t, torch.Tensor):
            bufs.append(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)
        else:
            bufs.append(np.ascontiguousarray(t).data)
    # No sample index in the file: its position is its name, and one file has several names
    # over its life (finalize's compaction renames it; `hsx merge` hard-links it into the
    # merged corpus under another index while the shard keeps it under its own), so an
    # index stored inside could not be true under both. Files written before carry one.
    return [wire.encode_header(specs, sample_file_meta(ctx)), *bufs]


def sample_file_meta(ctx: CorpusContext) -> dict[str, str]:
    return {"format": "hsx-speculators/1", "layer_ids": json.dumps(list(ctx.layer_ids))}


class SpeculatorsFormat(Eagle3Format):
    """speculators 0.9: positional hs_{i}.safetensors + a `datasets` table.

    Failed samples: speculators reads row i from hs_i, so the table cannot have holes.
    When `finalize` gets a subset of the planned indices (m samples), it compacts in place:
    each sample with index >= m is renamed into a hole below m (lowest tail -> lowest hole),
    so every file is either untouched or renamed once, and rows are 0..m-1. The moves
    are first written to `hsx_compaction.json` (atomically), then done with os.replace; a
    rerun after a crash recomputes the same plan from the same records, checks it against
    the journal and finishes it (a move whose source is gone and target present is done).
    The journal stays as the record of the renumbering: sample `old` now lives at `new`,
    so `verify_sample` must be given the new index for moved samples. The set of samples is
    final after that (no --retry-failed); a sample found bad is redone under its plan index
    and the rerun finalize moves it into its place again (the same journal).
    """

    name = "speculators"
    needs_final_norm = False  # states stay pre-norm
    format_facts: dict = {}  # what a variant adds to hsx_format.json (speculators_variants.py)

    @staticmethod
    def hs_path(index: int) -> str:
        return f"hidden_states/hs_{int(index)}.safetensors"

    def extra_paths(self, index: int) -> list[str]:
        """Files a sample may have besides hs_path (none here; a token table's image chats
        have their request file), moved with it by the compaction."""
        return []

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        # states + token id in the hs file, input_ids + loss_mask (int64) in the table
        return state_bytes_per_token(ctx) + 8 + 16

    def encode_sample(self, index: int, decoded: Decoded, ctx: CorpusContext) -> SampleOutput:
        hs, ids, mask, source = check_decoded(decoded, ctx)
        ids = np.ascontiguousarray(ids, dtype="<i8")
        parts = sample_file_parts(ctx, [("hidden_states", dtypes.st_code(hs.dtype), hs), ("token_ids", "I64", ids)])
        return SampleOutput({self.hs_path(index): parts}, make_record(ids, mask, source, ctx, getattr(decoded, "media_mask", None)))

    # A sample's file written as its states arrive (hsx_client.corpus.stream_write): the same
    # bytes as encode_sample's, in file order: the header (from the layout), the states
    # (token-major, as they come), the token ids (known last over HTTP).
    streams = True

    def stream_file(self, index: int, layout, ctx: CorpusContext) -> tuple[str, bytes]:
        """(the sample's file, its first bytes) for a stream of this `layout`."""
        check_layout(layout, ctx)
        t = layout.shape[0]
        specs = [wire.TensorSpec("hidden_states", dtypes.st_code(layout.dtype), tuple(layout.shape)),
                 wire.TensorSpec("token_ids", "I64", (t,))]
        return self.hs_path(index), wire.encode_header(specs, sample_file_meta(ctx))

    def stream_tail(self, head, ctx: CorpusContext) -> tuple[list, dict]:
        """(the file's last bytes, the sample's record) once the head is known."""
        ids, mask, source = check_tokens(head, ctx, head.shape[0])
        ids = np.ascontiguousarray(ids, dtype="<i8")
        return [ids.data], make_record(ids, mask, source, ctx, getattr(head, "media_mask", None))

    def prepare(self) -> None:
        import datasets  # noqa: F401  (finalize's table; ~1 s to import, done before the run)

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
            store.write_file_atomic(journal, json.dumps({"num_samples": m, "moves": moves}).encode())
        for old, new in moves:
            self._move(out_dir, old, new)
        if moves:
            for d in {(out_dir / rel).parent for rel in [self.hs_path(0), *self.extra_paths(0)]}:
                if d.exists():
                    store.fsync_dir(d)
        return moves

    def _move(self, out_dir: Path, old: int, new: int) -> None:
        """One compaction move: the sample file, then its extra files (those it has). The
        sample file goes first, so while it is still under its old name no extra file has
        moved yet: an extra file found then under the new name is a stale one of the sample
        that failed there (written, never recorded), removed, not taken for this one's."""
        src, dst = out_dir / self.hs_path(old), out_dir / self.hs_path(new)
        extras = [(out_dir / a, out_dir / b) for a, b in zip(self.extra_paths(old), self.extra_paths(new))]
        if src.exists():
            for x_src, x_dst in extras:
                if not x_src.exists() and x_dst.exists():
                    x_dst.unlink()
            os.replace(src, dst)
        elif not dst.exists():
            raise CorpusFormatError(f"sample {old} has no file {src} (and {dst} is absent)")
        for x_src, x_dst in extras:  # a rerun after a crash between the two finds the extra still here
            if x_src.exists():
                os.replace(x_src, x_dst)

    def finalize(self, out_dir: Path, records: list[tuple[int, dict]], ctx: CorpusContext) -> list[str]:
        """Write the table (rows 0..m-1), vocab files and hsx_format.json; see the class doc."""
        import datasets
        from datasets.arrow_writer import ArrowWriter

        out_dir = Path(out_dir)
        recs = sorted_records(records)
        indices = [i for i, _ in recs]
        moves = self._compact(out_dir, indices)
        # after compaction, hs_p holds the sample that had index p, or the one moved into p
        pos_of_old = dict(moves)
        rows = {pos_of_old.get(i, i): r for i, r in recs}
        if sorted(rows) != list(range(len(recs))):
            raise CorpusFormatError("compaction left holes")  # cannot happen; guards the plan

        tmp = store.temp_dir(out_dir, "hsx_finalize")  # cleaned by the next run after a crash
        try:
            media = any("media_runs" in r for r in rows.values())  # image chats: a media_mask column too
            feats = datasets.Features({
                "input_ids": datasets.Sequence(datasets.Value("int64")),
                "loss_mask": datasets.Sequence(datasets.Value("int64")),
                "seq_len": datasets.Value("int64"),
                **({"media_mask": datasets.Sequence(datasets.Value("int64"))} if media else {}),
            })
            freq = self._write_table(out_dir, rows, ctx, ArrowWriter(features=feats, path=str(tmp / "table.arrow")), media)
            ds = datasets.Dataset.from_file(str(tmp / "table.arrow"))
            ds.set_format("torch")
            ds.save_to_disk(str(tmp / "table"))
            del ds
            written = self._install_table(out_dir, tmp / "table")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

        extra = speculators_vocab_files(freq, ctx.draft_vocab_size, ctx.vocab_size)
        extra[FORMAT_FILE] = format_json(
            self.name, ctx, **self.format_facts, **self.draft_facts(ctx), num_samples=len(rows), num_tokens=sum(r["num_tokens"] for r in rows.values()),
            num_supervised=sum(r["num_supervised"] for r in rows.values()),
            **media_facts(rows.values()),
            compacted_moves=len(moves), compaction_journal=COMPACTION_JOURNAL if moves else None,
        )
        for rel, data in extra.items():
            store.write_file_atomic(out_dir / rel, data)
        written += list(extra)
        if moves or (out_dir / COMPACTION_JOURNAL).exists():
            written.append(COMPACTION_JOURNAL)
        return written

    def _write_table(self, out_dir: Path, rows: dict[int, dict], ctx: CorpusContext, writer, media: bool = False) -> Counter:
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
                ids_b, mask_b, media_b = [], [], []
                for p in range(start, min(len(rows), start + _TABLE_BATCH)):
                    ids = self._read_ids(out_dir, p).astype(np.int64, copy=False)
                    probs = record_problems(rows[p], ids)
                    if probs:
                        raise CorpusFormatError(f"{self.hs_path(p)}: " + "; ".join(probs))
                    ids_b.append(ids)
                    mask_b.append(runs_to_mask(rows[p]["mask_runs"]))
                    if media:
                        runs = rows[p].get("media_runs")
                        media_b.append(runs_to_mask(runs) if runs else np.zeros(len(ids), np.int64))
                flat_ids, flat_mask = np.concatenate(ids_b), np.concatenate(mask_b)
                if dense is not None and (flat_ids.size == 0 or 0 <= flat_ids.min() and flat_ids.max() < dense.size):
                    dense += np.bincount(flat_ids[flat_mask.astype(bool)], minlength=dense.size)
                else:
                    count_supervised(freq, flat_ids, flat_mask)
                lens = np.array([len(x) for x in ids_b], dtype=np.int64)
                offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
                columns = {
                    "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat_ids)),
                    "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(flat_mask)),
                    "seq_len": pa.array(lens),
                }
                if media:
                    columns["media_mask"] = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(media_b)))
                w.write_table(pa.table(columns))
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
            store.fsync_dir(out_dir)
        for stale in out_dir.glob("data-*-of-*.arrow"):
            if stale.name not in names:
                stale.unlink()
        for n in [n for n in names if n != "state.json"] + ["state.json"]:
            with open(table / n, "rb") as f:
                os.fsync(f.fileno())
            os.replace(table / n, out_dir / n)
        store.fsync_dir(out_dir)
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
        want_dt = dtypes.st_code(record["dtype"]) if record.get("dtype") in dtypes.STATE_DTYPES else None
        if want_dt and dtype != want_dt:
            probs.append(f"hidden_states dtype {dtype}, expected {want_dt}")
        if ids_t.dtype != torch.int64 or ids_t.ndim != 1:
            probs.append(f"token_ids must be int64 [T], got {ids_t.dtype} {list(ids_t.shape)}")
        return probs + record_problems(record, ids_t.numpy())
