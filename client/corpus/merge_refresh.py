"""`hsx merge OUT SHARD...` again after a shard changed: repaired (`hsx verify`, then its
`hsx extract`), or extracted again from the same plan.

OUT's plan.json names the shards by the checksums of their records, so a repaired shard
is not the shard OUT was merged from. When the shards are still the same run holding the
same samples (the same global plan, the same merged key list), OUT is brought up to date
instead of refused: a sample of OUT whose file is its shard's own (a hard link) is current;
any other (a copy across filesystems, a sample repaired in place in OUT, a link to the
file the shard's repair replaced) is checked against OUT's manifest and kept when intact,
else placed again from its shard. Steps, each safe to kill and rerun: the stale samples'
manifest lines are invalidated, hsx_corpus.json removed, plan.json rewritten with the new
merge id; then the merge goes on as a resumed one.

A sample placed again comes from a shard file checked against the shard's own checksum
first (`check_sources`): a shard still damaged is named, never linked into OUT.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hsx_client.corpus import journal, store
from hsx_client.corpus.merge_check import MergeError


def same_samples(saved: dict[str, Any], plan: dict[str, Any]) -> bool:
    """OUT's saved plan and the shards' merged plan are the same run's, sample for sample."""
    return saved["merge"].get("global_fingerprint") == plan["merge"]["global_fingerprint"] \
        and saved["keys"] == plan["keys"]


def _current(out: Path, row: Any, placement: list[tuple[str, str, dict[str, Any]]], entry: dict[str, Any]) -> bool:
    """OUT's files of `row` are its shard's own, or intact by OUT's manifest."""
    for src_rel, dst_rel, _ in placement:
        try:
            dst = os.stat(out / dst_rel)
        except FileNotFoundError:
            return False
        try:
            if os.path.samestat(dst, os.stat(row.shard.path / src_rel)):
                continue
        except FileNotFoundError:
            pass  # the shard lost it; OUT's own copy may still be whole
        meta = entry.get("files", {}).get(dst_rel)
        if meta is None or store.check_checksums(out, {"files": {dst_rel: meta}}):
            return False
    return True


def refresh(out: Path, rows: list[Any], placements: list[Any], plan: dict[str, Any]) -> int:
    """Bring OUT, merged from these shards before they changed, up to date; returns how many
    samples are to be placed again."""
    manifest = journal.JsonlLog(out / store.MANIFEST_NAME)
    try:
        done = journal.latest_by_index(manifest.entries)
        stale = [r for r in rows if r.index in done and not _current(out, r, placements[r.index], done[r.index])]
        manifest.extend({"index": r.index, "key": r.key, "invalid": True, "reason": "its shard changed"}
                        for r in stale)
    finally:
        manifest.close()
    corpus = out / store.CORPUS_NAME
    if corpus.exists():
        corpus.unlink()
        store.fsync_dir(out)
    store.write_json_atomic(out / store.PLAN_NAME, plan)
    return len(stale)


def check_sources(todo: list[Any], placements: list[Any], entries: list[dict[str, Any]]) -> None:
    """The shard files of samples OUT held before (invalidated: found bad, or stale after a
    shard changed) must check out before they are placed again (MergeError names the shard)."""
    before = {int(e["index"]) for e in entries if "index" in e}
    for row in todo:
        if row.index not in before:
            continue
        for src_rel, _, meta in placements[row.index]:
            problems = store.check_checksums(row.shard.path, {"files": {src_rel: meta}})
            if problems:
                raise MergeError(f"{row.shard.name}: sample {row.source}'s file is damaged too ({problems[0]}): "
                                 f"repair that shard first (`hsx verify {row.shard.path}`, then its hsx extract), "
                                 "then rerun this merge")
