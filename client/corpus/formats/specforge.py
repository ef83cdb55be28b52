"""SpecForge 0.2 offline: one torch.save'd `.ckpt` per sample in a sharded tree."""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hsx import dtypes
from hsx_client.corpus import store
from hsx_client.corpus.formats.common import (
    FORMAT_FILE, CorpusContext, media_facts, CorpusFormatError, Eagle3Format, SampleOutput, check_decoded, check_layout,
    check_tokens, format_json, make_record, record_problems, runs_to_mask, sorted_records, state_bytes_per_token,
)
from hsx_client.postnorm import apply_final_norm
from hsx_client.corpus.torch_zip import StorageRef, TensorRef, TorchZipWriter, pickle_object
from hsx_client.corpus.vocab import count_supervised, specforge_vocab_files

if TYPE_CHECKING:
    from hsx.wire import Decoded


def _need_final_norm(ctx: CorpusContext) -> None:
    """hidden_state is the last layer after the final norm: without it no sample can be written."""
    if ctx.final_norm is None:
        raise CorpusFormatError("the specforge format needs the final norm (weights, eps) from the server")


# Each draft's record (specforge/algorithms/<name>/providers.py; client/corpus/drafts.py):
# (key of the aux layers concatenated, key of the last layer after the final norm or None
# when the record has no last state and every layer is an aux one).
RECORD_KEYS = {
    "eagle3": ("aux_hidden_state", "hidden_state"),
    "dspark": ("hidden_states", "target_last_hidden_states"),
    "dflash": ("hidden_states", None),
    "domino": ("hidden_states", None),
}
DFLASH_FAMILY = ("dflash", "dspark", "domino")


class SpecForgeFormat(Eagle3Format):
    """SpecForge 0.2 offline: one torch.save'd `.ckpt` per sample in a sharded tree.

    SpecForge lists every `*.ckpt` under the directory and has no positional index, so
    failed samples simply leave no file. `finalize` renames any `*.ckpt` under rows/ that
    no record accounts for (a file completed but never recorded before a crash) to
    `*.ckpt.orphan`, so the trainer cannot read unaccounted data, then writes
    vocab_mapping/vocab_mapping.pt and hsx_format.json (each tmp + fsync + rename).
    """

    name = "specforge"
    needs_final_norm = True  # hidden_state is the last layer after the final norm

    @property
    def keys(self) -> tuple[str, str | None]:
        """(aux key, last key or None) of this draft's record."""
        return RECORD_KEYS[self.draft]

    def drop_reason(self, mask: np.ndarray) -> str | None:
        """EAGLE-3: SpecForge's offline normalizer (specforge.algorithms.eagle3.data) sets the
        last token's mask to 0 (its target lies past the sample): a sample supervised only
        there trains nothing. The DFlash family's normalizer refuses a sample without two
        consecutive supervised tokens (specforge/algorithms/common/dflash_family_data.py)."""
        if self.draft in DFLASH_FAMILY:
            if not (mask[1:].astype(bool) & mask[:-1].astype(bool)).any():
                return "no two consecutive supervised tokens, which SpecForge's DFlash-family loader requires"
            return None
        if not mask[:-1].any():
            return "no supervised token but the last, which SpecForge's loader unmasks"
        return None

    @staticmethod
    def ckpt_path(index: int) -> str:
        return f"rows/{int(index) // 1000:04d}/data_{int(index)}.ckpt"

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        # aux (3 layers) + last states, input_ids + loss_mask (int64)
        return state_bytes_per_token(ctx) + 16

    def encode_sample(self, index: int, decoded: Decoded, ctx: CorpusContext) -> SampleOutput:
        aux_key, last_key = self.keys
        if last_key:
            _need_final_norm(ctx)
        hs, ids, mask, source = check_decoded(decoded, ctx)
        n_aux = hs.shape[1] - (1 if last_key else 0)
        # torch.cat / fresh tensors: torch.save must not drag a shared storage along.
        obj = {
            "input_ids": torch.from_numpy(ids.copy()),
            "loss_mask": torch.from_numpy(mask.copy()),
            aux_key: torch.cat([hs[:, k] for k in range(n_aux)], dim=-1).unsqueeze(0),
        }
        if last_key:
            obj[last_key] = apply_final_norm(hs[:, -1], ctx.final_norm).contiguous().unsqueeze(0)
        buf = io.BytesIO()
        torch.save(obj, buf)
        return SampleOutput({self.ckpt_path(index): buf.getvalue()}, make_record(ids, mask, source, ctx, getattr(decoded, "media_mask", None)))

    # A sample's file written as its states arrive (hsx_client.corpus.stream_write): a
    # torch.save archive (hsx_client.corpus.torch_zip) of one storage of [T, 4H] rows, each
    # token's layers as they came with the last one normed per chunk (stream_chunk);
    # aux_hidden_state and hidden_state are views of it. torch.load gives the tensors
    # encode_sample saves (as views: SpecForge's loader takes them as they are).
    streams = True

    def stream_open(self, index: int, layout, ctx: CorpusContext) -> _StreamedCkpt:
        return _StreamedCkpt(self, index, layout, ctx)

    def stream_chunk(self, data, layout, ctx: CorpusContext) -> memoryview:
        """The chunk's rows with the last layer normed, in a fresh buffer (the chunk may be
        a lease's shared memory, read in place: never written)."""
        _, n_layers, h = layout.shape
        if self.keys[1] is None:  # no last state in the record: the rows go as they came
            return data
        out = np.frombuffer(data, dtype=np.uint8).copy()  # numpy's memory: tracemalloc counts it
        rows = torch.from_numpy(out).view(layout.dtype).view(-1, n_layers, h)
        rows[:, -1] = apply_final_norm(rows[:, -1], ctx.final_norm)
        return out.data

    def _load(self, path: Path) -> dict:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)

    def finalize(self, out_dir: Path, records: list[tuple[int, dict]], ctx: CorpusContext) -> list[str]:
        """Quarantine unrecorded ckpt files, write the vocab mapping and hsx_format.json."""
        out_dir = Path(out_dir)
        recs = sorted_records(records)
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
            probs = record_problems(rec, ids)
            if probs:
                raise CorpusFormatError(f"{self.ckpt_path(i)}: " + "; ".join(probs))
            count_supervised(freq, ids, runs_to_mask(rec["mask_runs"]))
        files = specforge_vocab_files(freq, ctx.draft_vocab_size, ctx.vocab_size)
        files[FORMAT_FILE] = format_json(
            self.name, ctx, num_samples=len(recs), num_tokens=sum(r["num_tokens"] for _, r in recs),
            num_supervised=sum(r["num_supervised"] for _, r in recs), orphans_quarantined=orphans,
            **media_facts(r for _, r in recs), **self._last_fact(ctx), **self.draft_facts(ctx),
        )
        for rel, data in files.items():
            store.write_file_atomic(out_dir / rel, data)
        return list(files)

    def _last_fact(self, ctx: CorpusContext) -> dict:
        last_key = self.keys[1]
        if last_key is None:
            return {}
        return {last_key: "final norm applied (" + (ctx.final_norm.style if ctx.final_norm else "?") + ")"}

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]:
        path = Path(out_dir) / self.ckpt_path(index)
        if not path.exists():
            return [f"{self.ckpt_path(index)} is missing"]
        try:
            raw = self._load(path)
        except Exception as exc:
            return [f"{path.name} is unreadable: {type(exc).__name__}: {exc}"]
        aux_key, last_key = self.keys
        need = {"input_ids", "loss_mask", aux_key} | ({last_key} if last_key else set())
        if not isinstance(raw, dict) or not need <= set(raw):
            return [f"{path.name} lacks {sorted(need - set(raw if isinstance(raw, dict) else {}))}"]
        t, h = record.get("num_tokens"), record.get("hidden_size")
        n_aux = record.get("num_layers", 4) - (1 if last_key else 0)
        want_dt = dtypes.torch_dtype(record["dtype"]) if record.get("dtype") in dtypes.STATE_DTYPES else None
        probs = []
        wants = [("input_ids", [t], torch.int64), ("loss_mask", [t], torch.int64), (aux_key, [1, t, n_aux * h], want_dt)]
        for key, shape, dt in wants + ([(last_key, [1, t, h], want_dt)] if last_key else []):
            v = raw[key]
            if list(v.shape) != shape:
                probs.append(f"{key} shape {list(v.shape)}, expected {shape}")
            if dt is not None and v.dtype != dt:
                probs.append(f"{key} dtype {v.dtype}, expected {dt}")
        probs += record_problems(record, raw["input_ids"].numpy())
        if not probs and not np.array_equal(raw["loss_mask"].numpy(), runs_to_mask(record["mask_runs"])):
            probs.append("loss_mask differs from the record")
        return probs


class _StreamedCkpt:
    """One sample's `.ckpt` front to back (stream_write: begin, chunk..., end): the pickle
    and the states storage go first (their sizes are known from the layout), the token ids
    and loss mask last (over HTTP they arrive after the states)."""

    def __init__(self, fmt: SpecForgeFormat, index: int, layout, ctx: CorpusContext) -> None:
        aux_key, last_key = fmt.keys
        if last_key:
            _need_final_norm(ctx)
        check_layout(layout, ctx)
        self.fmt, self.layout, self.ctx = fmt, layout, ctx
        self.rel = fmt.ckpt_path(index)
        t, n_layers, h = layout.shape
        self.tokens = t
        states = StorageRef("0", layout.dtype, t * n_layers * h)
        rows = (t * n_layers * h, n_layers * h, 1)  # [1, T, .] over rows of n_layers * h
        n_aux = n_layers - (1 if last_key else 0)
        self._states_bytes = states.nbytes
        tensors = {
            "input_ids": TensorRef(StorageRef("1", torch.int64, t), 0, (t,), (1,)),
            "loss_mask": TensorRef(StorageRef("2", torch.int64, t), 0, (t,), (1,)),
            aux_key: TensorRef(states, 0, (1, t, n_aux * h), rows),
        }
        if last_key:
            tensors[last_key] = TensorRef(states, n_aux * h, (1, t, h), rows)
        self._pickled = pickle_object(tensors)
        self._zip: TorchZipWriter | None = None
        self._states = None

    def begin(self, write) -> None:
        self._zip = TorchZipWriter(write)
        self._zip.begin(self._pickled)
        self._states = self._zip.open_record("data/0", self._states_bytes)

    def chunk(self, data) -> None:
        self._states.write(self.fmt.stream_chunk(data, self.layout, self.ctx))

    def end(self, head) -> dict:
        ids, mask, source = check_tokens(head, self.ctx, self.tokens)
        self._states.close()
        self._zip.record("data/1", np.ascontiguousarray(ids, dtype="<i8").data)
        self._zip.record("data/2", np.ascontiguousarray(mask, dtype="<i8").data)
        self._zip.close()
        return make_record(ids, mask, source, self.ctx, getattr(head, "media_mask", None))

    def abort(self) -> None:
        if self._zip is not None:
            self._zip.abandon()
