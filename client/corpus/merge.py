"""`hsx merge OUT SHARD_DIR...`: the shards of one sharded run (`hsx extract --shard I/N`)
as one corpus, which speculators and SpecForge read whole and `hsx verify` checks.

What the merged corpus is: the samples of every shard in global plan order (shard 0's,
then shard 1's, ...; each shard's in its plan order, failed samples left out), renumbered
0..m-1 (`hs_{i}` / `data_{i}.ckpt`), with one table, token_freq.pt and the vocab mappings
rebuilt by the format's own `finalize` over all of them, a manifest whose lines carry the
shards' records and checksums, and hsx_corpus.json listing every shard. Without failures
it is, row for row, the corpus one client would have written from the same plan. What each
shard says about its own samples (counts, the indices it dropped or failed) is combined,
not compared: dropped and failed samples are listed by key per shard and by their index in
the global plan (they have none in the merged numbering, which holds stored samples only).

Steps (OUT locked; every step can be killed and rerun):
 1. read and check the shards (`merge_check`): anything that disagrees is refused, exit 2;
 2. plan.json: the merged key list and a "merge" section naming every shard with the
    checksums of its plan.json and hsx_corpus.json. It is written before anything else and
    is the journal: a rerun recomputes it from the shards and continues if it is the same;
    shards repaired since (the same samples) bring OUT up to date (merge_refresh); else it
    refuses: OUT holds a merge of other shards;
 3. the sample files, in batches: each is hard-linked from its shard under its new name;
    then the batch's directories are fsync'ed and its manifest lines appended in one fsync.
    A rerun skips the samples with a manifest line and redoes the rest (a link already in
    place is kept). Across filesystems (EXDEV), or where links are refused, a file is
    copied instead: to a temporary name, checksummed against the shard's manifest while
    copying, fsync'ed, renamed. A speculators file from a client that still wrote its
    sample index into the file's metadata is copied the same way with that entry left out
    (its new checksum in the manifest): in OUT it sits at another index;
 4. the format's finalize (table, vocab files, hsx_format.json; itself rerunnable);
 5. hsx_corpus.json, written last: its presence marks a finished merge.

Why hard links and not renames: a link leaves every shard whole, so a shard can still be
verified, merged again (another OUT, other shards) or kept as its node's record, and a
crashed merge never has files in two half-states; the bytes are stored once either way.
Links are safe because no hsx writer modifies a file in place (every write is a new file
renamed over the old name): a shard redone later gets new inodes, the merged corpus keeps
its own.

Exit codes: 0 merged, 1 stopped on an error (rerun to resume), 2 refused, 130 interrupted.

Fault injection for tests: HSX_FAULT_MERGE=POINT[:N] SIGKILLs the process at POINT, one of
`plan` (after plan.json), `place:N` (after N samples' files are in place, before their
manifest lines), `manifest:N` (after N manifest lines), `finalize` (before hsx_corpus.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hsx.exit_codes import ExitCode
from hsx import __version__ as hsx_version
from hsx.host import usable_cores

from hsx_client.corpus import journal, merge_refresh, store
from hsx_client.corpus.formats import CorpusContext, format_options, get_format
from hsx_client.corpus.settings import CorpusSettings
from hsx_client.corpus.merge_check import PER_SHARD_CORPUS_FIELDS, MergeError, MergeRefused, Shard, load_all
from hsx_client.corpus.merge_place import Placer
from hsx_client.corpus.merged import REPAIRING_NAME
from hsx_client.corpus.plan import PLAN_VERSION, split_dropped
from hsx_client.corpus.provenance import files_digest
from hsx_client.corpus.verify import renumbered_path

FAULT_ENV = "HSX_FAULT_MERGE"
BATCH = 64  # samples placed between two manifest commits


@dataclass
class Row:
    """One merged sample: where it comes from and its new index."""

    index: int
    shard: Shard
    source: int  # the sample's index in its shard's manifest
    entry: dict[str, Any]

    @property
    def key(self) -> str:
        return self.entry["key"]


@dataclass
class MergeResult:
    exit_code: int
    status: str  # complete | refused | error | interrupted
    summary: dict[str, Any]


def _fault(point: str, n: int | None = None) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, at = spec.partition(":")
    if name == point and (not at or (n is not None and n >= int(at))):
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- plan
def global_index(sh: Shard, i: int) -> int:
    """A shard's sample index in the global plan (shards are contiguous slices of it)."""
    return int(sh.section["start"]) + i


def plan_rows(shards: list[Shard]) -> list[Row]:
    rows: list[Row] = []
    for sh in shards:
        for i in sorted(sh.done):
            rows.append(Row(len(rows), sh, i, sh.done[i]))
    return rows


def merge_section(shards: list[Shard]) -> dict[str, Any]:
    # A shard's manifest only grows (a repair appends lines): its length tells a repaired shard even
    # when its finalize rewrote an hsx_corpus.json of the same bytes.
    ident = [(sh.index, sh.plan_sha256, sh.corpus_sha256, sh.manifest_bytes) for sh in shards]
    sec = shards[0].section
    return {
        "id": hashlib.sha256(json.dumps(ident).encode()).hexdigest(),
        "global_fingerprint": sec["global_fingerprint"],
        "global_samples": sec["global_samples"],
        "num_shards": sec["count"],
        "shards": [
            {"index": sh.index, "path": str(Path(sh.path).resolve()), "plan_sha256": sh.plan_sha256,
             "corpus_sha256": sh.corpus_sha256, "manifest_bytes": sh.manifest_bytes, "done": len(sh.done),
             "failed": len(sh.failed)}
            for sh in shards
        ],
    }


def merged_plan(shards: list[Shard], rows: list[Row]) -> dict[str, Any]:
    p0 = shards[0].plan
    plan = {k: p0.get(k) for k in ("settings", "inputs", "inputs_sha256", "input_files", "num_input_samples",
                                   "bad_rows", "model", "model_revision")}
    plan.update(version=PLAN_VERSION, created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                keys=[r.key for r in rows], merge=merge_section(shards))
    return plan


def _dst_files(fmt: Any, row: Row) -> list[tuple[str, str, dict[str, Any]]]:
    """[(path in the shard now, path in OUT, manifest meta)] of one sample's files."""
    out = []
    now = row.shard.moves.get(row.source, row.source)  # the shard's finalize may have renumbered it
    for rel, meta in row.entry.get("files", {}).items():
        if renumbered_path(fmt, rel, row.source, row.source + 1) == rel:
            raise MergeRefused([f"{row.shard.name}: sample {row.source} has a file {rel} that is not a per-sample "
                                f"path of the {fmt.name} format; it cannot be renumbered"])
        src = renumbered_path(fmt, rel, row.source, now)
        try:  # a per-sample name, but maybe a symlink out of the shard: never link that in
            store.inside(row.shard.path, src)
        except store.UnsafePathError as exc:
            raise MergeRefused([f"{row.shard.name}: sample {row.source}'s file {exc}"]) from None
        out.append((src, renumbered_path(fmt, rel, row.source, row.index), meta))
    return out


# ---------------------------------------------------------------- the run
class Merger:
    def __init__(self, out: Path, shard_dirs: list[Path], *, workers: int | None = None, quiet: bool = True):
        self.out = Path(out)
        self.shard_dirs = [Path(p) for p in shard_dirs]
        self.workers = workers or max(2, min(8, 2 * usable_cores()))
        self.quiet = quiet
        self.placer = Placer()
        self.refreshed = 0  # samples placed again because their shard changed (merge_refresh)

    def run(self) -> MergeResult:
        t0 = time.monotonic()
        try:
            lock = journal.DirLock(self.out).acquire("hsx merge")
        except store.StoreError as exc:
            return MergeResult(ExitCode.REFUSED, "refused", {"problems": [str(exc)]})
        try:
            summary = self._run_locked()
        except MergeRefused as exc:
            return MergeResult(ExitCode.REFUSED, "refused", {"problems": exc.problems})
        except (MergeError, OSError) as exc:
            return MergeResult(ExitCode.FAILED, "error", {"message": f"{exc} (rerun the same command to resume)"})
        except KeyboardInterrupt:
            return MergeResult(ExitCode.INTERRUPTED, "interrupted", {"message": "interrupted; rerun to resume"})
        finally:
            lock.release()
        summary["seconds"] = round(time.monotonic() - t0, 3)
        return MergeResult(ExitCode.OK, "complete", summary)

    def _run_locked(self) -> dict[str, Any]:
        out = self.out
        store.clean_temp_files(out)
        shards = load_all(out, self.shard_dirs)
        # The shards agree on the format and its options (merge_check): --dtype fp8 and
        # --states none shards merge as their format's own variant.
        fmt = get_format(shards[0].corpus["format"], **format_options(CorpusSettings.saved(shards[0].plan["settings"])))
        rows = plan_rows(shards)
        if not rows:
            raise MergeRefused(["the shards hold no sample (every one failed): nothing to merge"])
        placements = [_dst_files(fmt, r) for r in rows]  # refuses unknown file layouts before any write
        plan = self._journal(shards, rows, placements)

        manifest = journal.JsonlLog(out / store.MANIFEST_NAME)
        try:
            done = self._done(manifest, plan["keys"])
            todo = [r for r in rows if r.index not in done]
            merge_refresh.check_sources(todo, placements, manifest.entries)
            if todo and (out / store.CORPUS_NAME).exists():
                (out / store.CORPUS_NAME).unlink()  # files went missing since: not finished any more
                store.fsync_dir(out)
            self._place_all(todo, placements, manifest, done)
        finally:
            manifest.close()
        if (out / store.CORPUS_NAME).exists():
            corpus = json.loads((out / store.CORPUS_NAME).read_text())
            return self._summary(shards, corpus, message="already complete")
        fmt.prepare()
        written = list(fmt.finalize(out, sorted((i, e["record"]) for i, e in done.items()), self._context(shards)) or [])
        for rel in written:
            store.fsync_dir((out / rel).parent)
        _fault("finalize")
        corpus = self._provenance(shards, plan, done, written)
        store.write_json_atomic(out / store.CORPUS_NAME, corpus)
        if (out / REPAIRING_NAME).exists():  # an `hsx extract` repair of OUT that this merge finished instead
            (out / REPAIRING_NAME).unlink()
        return self._summary(shards, corpus)

    def _journal(self, shards: list[Shard], rows: list[Row], placements: list) -> dict[str, Any]:
        out = self.out
        plan = merged_plan(shards, rows)
        path = out / store.PLAN_NAME
        if path.exists():
            saved = json.loads(path.read_text())
            if not saved.get("merge"):
                raise MergeRefused([f"{out} holds an extraction, not a merge: pick a new output"])
            if saved["merge"]["id"] == plan["merge"]["id"] and saved["keys"] == plan["keys"]:
                return saved
            if not merge_refresh.same_samples(saved, plan):
                raise MergeRefused([f"{out} holds a merge of other shards (or of shards extracted again with other "
                                    "samples): pick a new output, or give the same shards"])
            self.refreshed = merge_refresh.refresh(out, rows, placements, plan)  # a shard was repaired
            return plan
        others = [p.name for p in out.iterdir() if p.name != store.LOCK_NAME]
        if others:
            raise MergeRefused([f"{out} is not empty and holds no merge ({', '.join(sorted(others)[:5])}): "
                                "pick an empty or new output"])
        store.write_json_atomic(path, plan)
        _fault("plan")
        return plan

    def _done(self, manifest: journal.JsonlLog, keys: list[str]) -> dict[int, dict[str, Any]]:
        """Samples recorded by an earlier run whose files are still in place."""
        done = journal.latest_by_index(manifest.entries)
        for i, e in list(done.items()):
            if i >= len(keys) or e.get("key") != keys[i]:
                raise MergeError(f"{self.out}/{store.MANIFEST_NAME}: line for index {i} does not match the merge plan")
            if store.check_sizes(self.out, e):
                del done[i]
        return done

    def _place_all(self, todo: list[Row], placements: list, manifest: journal.JsonlLog,
                   done: dict[int, dict[str, Any]]) -> None:
        bar = None
        if not self.quiet and todo:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="merge", unit="sample", file=sys.stderr, dynamic_ncols=True)
        placed = 0

        def one(row: Row) -> dict[str, Any]:
            files = {}
            for src_rel, dst_rel, meta in placements[row.index]:
                files[dst_rel] = self.placer.place(row.shard.path / src_rel, self.out / dst_rel, meta)
            return {**{k: v for k, v in row.entry.items() if k not in ("index", "files")},
                    "index": row.index, "files": files, "shard": row.shard.index, "shard_index": row.source}

        try:
            with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hsx-merge") as pool:
                for start in range(0, len(todo), BATCH):
                    batch = todo[start:start + BATCH]
                    entries = []
                    for entry in pool.map(one, batch):
                        entries.append(entry)
                        placed += 1
                        _fault("place", placed)
                    for d in {(self.out / rel).parent for e in entries for rel in e["files"]}:
                        store.fsync_dir(d)
                    manifest.extend(entries)
                    done.update((e["index"], e) for e in entries)
                    _fault("manifest", placed)
                    if bar is not None:
                        bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()

    @staticmethod
    def _context(shards: list[Shard]) -> CorpusContext:
        c = shards[0].corpus
        norm = c.get("final_norm") or {}
        return CorpusContext(
            layer_ids=list(c["layer_ids"]), hidden_size=int(c["hidden_size"]), dtype=c["dtype"],
            # finalize never applies the norm (encode_sample did, on the nodes); it names its style.
            final_norm=SimpleNamespace(style=norm.get("style"), eps=norm.get("eps")) if norm.get("style") else None,
            draft_vocab_size=c.get("draft_vocab_size"), vocab_size=c.get("vocab_size"), mask_policy=c.get("mask_policy"),
        )

    def _provenance(self, shards: list[Shard], plan: dict[str, Any], done: dict[int, dict[str, Any]],
                    written: list[str]) -> dict[str, Any]:
        c0 = shards[0].corpus
        corpus = {k: v for k, v in c0.items() if k not in PER_SHARD_CORPUS_FIELDS}
        versions: dict[str, Any] = {}
        for sh in shards:
            for k, v in (sh.corpus.get("versions") or {}).items():
                versions.setdefault(k, [])
                if v not in versions[k]:
                    versions[k].append(v)
        merge = dict(plan["merge"])
        # Per-shard facts are combined, not compared (merge_check): each shard's failed and
        # dropped samples by key, and all of them by their index in the global plan (the
        # merged corpus's own numbering holds only stored samples: they have none there).
        not_stored = [split_dropped(sh.failed) for sh in shards]  # (failed, dropped) by the shard's index
        merge["shards"] = [
            {**s, "created_at": sh.corpus.get("created_at"), "tokens": sh.corpus.get("counts", {}).get("tokens"),
             "versions": sh.corpus.get("versions"),
             "failed_keys": [sh.plan["keys"][i] for i in sorted(failed)],
             "dropped_keys": [sh.plan["keys"][i] for i in sorted(dropped)]}
            for s, sh, (failed, dropped) in zip(plan["merge"]["shards"], shards, not_stored)
        ]
        merge["global_failed_indices"] = sorted(global_index(sh, i) for sh, (f, _) in zip(shards, not_stored) for i in f)
        merge["global_dropped_indices"] = sorted(global_index(sh, i) for sh, (_, d) in zip(shards, not_stored) for i in d)
        corpus.update(
            created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            inputs=c0.get("inputs"),
            versions={k: v[0] if len(v) == 1 else v for k, v in versions.items()} | {"hsx_merge": hsx_version},
            merge=merge,
            counts={
                "planned": len(done), "done": len(done), "failed": 0, "dropped": 0,
                "truncated": sum(1 for e in done.values() if e.get("truncated_from")),
                "bad_rows": c0.get("counts", {}).get("bad_rows"),
                "input_samples": c0.get("counts", {}).get("input_samples"),
                "tokens": sum(int(e.get("tokens", 0)) for e in done.values()),
                "global_planned": plan["merge"]["global_samples"],
                "global_failed": len(merge["global_failed_indices"]),
                "global_dropped": len(merge["global_dropped_indices"]),
            },
            failed_indices=[],
            dropped_indices=[],
            finalize_files=files_digest(self.out, written),
        )
        return corpus

    def _summary(self, shards: list[Shard], corpus: dict[str, Any], message: str | None = None) -> dict[str, Any]:
        s = {
            "output": str(self.out), "shards": len(shards), "samples": corpus["counts"]["done"],
            "tokens": corpus["counts"]["tokens"], "failed_in_shards": corpus["counts"].get("global_failed", 0),
            "dropped_in_shards": corpus["counts"].get("global_dropped", 0),
            "linked": self.placer.links, "copied": self.placer.copies, "rewritten": self.placer.rewrites,
            "refreshed": self.refreshed,
            "corpus": str(self.out / store.CORPUS_NAME),
        }
        if message:
            s["message"] = message
        return s


def run_merge(out: Path, shard_dirs: list[Path], *, workers: int | None = None, quiet: bool = True) -> MergeResult:
    return Merger(out, shard_dirs, workers=workers, quiet=quiet).run()
