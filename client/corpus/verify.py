"""`hsx verify`: re-check a corpus (counts, files, checksums, the format's own check).

`verify_samples` is the full check of stored samples (also `hsx extract --verify`);
`verify_corpus` checks a whole corpus directory against its plan and manifest and
writes `verify.json` listing the bad samples, which the next `hsx extract` redoes.
Samples a format renumbered in finalize (speculators compacts failed indices away;
`hsx_compaction.json`) are checked under their new index, or under the old one while
the compaction is unfinished (a crash between the journal and the last rename: the
sample is intact under its old name, and the next `hsx extract` finishes the moves).
Verify never calls such a sample bad or missing, so it never strands the corpus; a bad
sample of a renumbered corpus is redone by the next `hsx extract` under its manifest index
and moved back into place by its finalize. A recorded path that is absolute or leads out of
the corpus (`..`, a symlink) is a problem of its sample, never opened (store.inside).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hsx.host import usable_cores
from hsx_client.corpus import journal, store
from hsx_client.corpus.merged import record as merged_record
from hsx_client.corpus.plan import ConfigError, failed_for_good, load_plan, split_dropped


def verify_samples(
    out: Path,
    fmt: Any,
    keys: list[str],
    done: dict[int, dict[str, Any]],
    *,
    workers: int | None = None,
    quiet: bool = True,
) -> list[dict[str, Any]]:
    """Full check of stored samples: sizes, checksums, then `fmt.verify_sample`."""
    out = Path(out)
    moved = compaction_moves(out)

    def one(item: tuple[int, dict[str, Any]]) -> dict[str, Any] | None:
        i, e = item
        problems: list[str] = []
        if i >= len(keys) or e.get("key") != keys[i]:
            problems.append(f"manifest key {e.get('key')!r} is not the plan's for index {i}")
        now = moved.get(i, i)
        if now != i and not _still_at_old_name(out, e):  # renumbered: same bytes under the new index's name
            e = dict(e, files={renumbered_path(fmt, rel, i, now): m for rel, m in e.get("files", {}).items()})
        elif now != i:  # the compaction stopped before this move: check it where it still is
            now = i
        problems += store.check_checksums(out, e)  # refuses a recorded path outside the corpus
        problems += _format_paths_outside(fmt, out, now)
        if not problems:
            try:
                problems += list(fmt.verify_sample(out, now, e.get("record", {})) or [])
            except Exception as exc:  # a reader error is a bad sample
                problems.append(f"verify_sample raised {type(exc).__name__}: {exc}")
        return {"index": i, "key": e.get("key"), "problems": problems} if problems else None

    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(done), desc="verify", unit="sample", file=sys.stderr, dynamic_ncols=True)
    bad = []
    with ThreadPoolExecutor(max_workers=workers or max(2, min(16, usable_cores()))) as pool:
        for r in pool.map(one, sorted(done.items())):
            if bar is not None:
                bar.update(1)
            if r is not None:
                bad.append(r)
    if bar is not None:
        bar.close()
    return bad


def _sample_path_fns(fmt: Any) -> list[Callable[[int], str]]:
    """The format's per-sample path functions (index -> relative path)."""
    return [fn for fn in (getattr(fmt, attr, None) for attr in ("hs_path", "ckpt_path", "request_path")) if fn is not None]


def _format_paths_outside(fmt: Any, out: Path, index: int) -> list[str]:
    """The format reads sample `index` from its own path: not through a symlink out."""
    problems = []
    for fn in _sample_path_fns(fmt):
        try:
            store.inside(out, fn(index))
        except store.UnsafePathError as exc:
            problems.append(str(exc))
    return problems


def compaction_moves(out: Path) -> dict[int, int]:
    p = Path(out) / store.COMPACTION_JOURNAL
    if not p.exists():
        return {}
    return {int(a): int(b) for a, b in json.loads(p.read_text()).get("moves", [])}


def _still_at_old_name(out: Path, entry: dict[str, Any]) -> bool:
    """A compaction move is one os.replace: while the old name exists, it was not done."""
    files = entry.get("files", {})
    return bool(files) and all((out / rel).exists() for rel in files)


def renumbered_path(fmt: Any, rel: str, old: int, new: int) -> str:
    """The path of a sample file after finalize moved sample `old` to `new`."""
    for fn in _sample_path_fns(fmt):
        if fn(old) == rel:
            return fn(new)
    return rel


def verify_corpus(out: Path, get_format: Callable[[str], Any] | None = None, *, quiet: bool = True,
                  workers: int | None = None) -> dict[str, Any]:
    """`hsx verify DIR`: returns the report; writes DIR/verify.json listing bad samples
    (removed when none) so the next `hsx extract` redoes exactly those. `get_format`
    (name -> format writer) defaults to hsx_client.corpus.formats.get_format."""
    out = Path(out)
    if not (out / store.PLAN_NAME).exists():
        raise ConfigError(f"{out} is not an hsx corpus (no {store.PLAN_NAME})")
    with journal.DirLock(out).acquire("hsx verify"):
        store.clean_temp_files(out)  # a killed writer's leftovers (finalize's .hsx_finalize... dir)
        if get_format is None:
            from hsx_client.corpus.formats import get_format
        plan = load_plan(out)
        assert plan is not None
        keys = plan["keys"]
        n = len(keys)
        from hsx_client.corpus.formats import format_options
        from hsx_client.corpus.settings import CorpusSettings

        settings = CorpusSettings.saved(plan["settings"])
        fmt = get_format(settings.format, **format_options(settings))
        entries, _, torn = journal.read_jsonl(out / store.MANIFEST_NAME)
        done = journal.latest_by_index(entries)
        problems: list[str] = []
        extra = [i for i in done if i >= n]
        if extra:
            problems.append(f"manifest has indices beyond the plan's {n}: {extra[:10]}")
            for i in extra:
                del done[i]
        merge = plan.get("merge")
        # A merged corpus holds no failed sample of its own (a repair that failed leaves its
        # sample missing); what its shards failed and dropped is in the merge's record.
        failed = {} if merge else failed_for_good(out, n, done)
        failures, dropped = split_dropped(failed)
        bad = verify_samples(out, fmt, keys, done, workers=workers, quiet=quiet)
        missing = [i for i in range(n) if i not in done and i not in failed]
        if missing:
            problems.append(f"{len(missing)} planned sample(s) not extracted yet (first: {missing[:10]})")
        problems += _corpus_record_problems(out, n, len(done), len(failed))
        if merge:  # the shards' counts, as the merge recorded them
            failures, dropped, of_merge = _merged_counts(out, merge)
            of_merge["shards_sharing_bad_files"] = _linked_shards(out, bad, done)
        report = {
            "ok": not bad and not problems,
            "output": str(out),
            "planned": n,
            "done": len(done),
            "failed": len(failures),
            "dropped": len(dropped),
            "missing": len(missing),
            "bad_samples": len(bad),
            "bad": bad,
            "problems": problems,
            "torn_manifest_lines": torn,
            **({"merged": of_merge} if merge else {}),
        }
        vpath = out / store.VERIFY_NAME
        if bad:
            store.write_json_atomic(vpath, {"checked_at": time.time(), "bad": bad})
        elif vpath.exists():
            vpath.unlink()
            store.fsync_dir(out)
        return report


def _corpus_record_problems(out: Path, n: int, done: int, not_stored: int) -> list[str]:
    """corpus.json against the manifest (counts) and the finalize outputs against their
    recorded checksums."""
    problems: list[str] = []
    corpus_path = out / store.CORPUS_NAME
    if not corpus_path.exists():
        problems.append(f"no {store.CORPUS_NAME}: the run was not finalized"
                        + (" (a renumbering was interrupted)" if (out / store.COMPACTION_JOURNAL).exists() else "")
                        + "; rerun the same `hsx extract` command to finish it")
    else:
        corpus = json.loads(corpus_path.read_text())
        counts = corpus.get("counts", {})
        recorded = counts.get("failed", 0) + counts.get("dropped", 0)
        if counts.get("planned") != n or counts.get("done") != done or recorded != not_stored:
            problems.append(
                f"{store.CORPUS_NAME} counts {counts.get('planned')}/{counts.get('done')}/{recorded} "
                f"(planned/done/not stored) do not match the manifest {n}/{done}/{not_stored}"
            )
        for rel, meta in (corpus.get("finalize_files") or {}).items():
            algo, want = store.recorded_digest(meta) or (store.HASH_ALGO, None)
            try:
                size, digest = store.hash_file(store.inside(out, rel), algo=algo)
            except store.UnsafePathError as exc:
                problems.append(f"{store.CORPUS_NAME} names a finalize output {exc}")
                continue
            except FileNotFoundError:
                problems.append(f"finalize output {rel} is missing")
                continue
            if size != meta.get("size") or digest != want:
                problems.append(f"finalize output {rel} changed since finalize (size/checksum)")
    return problems


def _merged_counts(out: Path, merge: dict[str, Any]) -> tuple[list[int], list[int], dict[str, Any]]:
    """(failed, dropped: by index in the global plan, facts of the merge) of a merged
    corpus, from its record (hsx_corpus.json, or the copy a repair keeps aside)."""
    doc = merged_record(out) or {}
    m = doc.get("merge") or {}
    shards = [{"index": s.get("index"), "path": s.get("path")} for s in merge.get("shards", [])]
    return (list(m.get("global_failed_indices", [])), list(m.get("global_dropped_indices", [])),
            {"shards": shards, "global_planned": merge.get("global_samples")})


def _linked_shards(out: Path, bad: list[dict[str, Any]], done: dict[int, dict[str, Any]]) -> list[int]:
    """The shards whose own files the merged corpus's bad samples are (hard links: the
    same damage is in the shard)."""
    shards = set()
    for b in bad:
        e = done.get(b["index"], {})
        for rel in e.get("files", {}):
            try:
                linked = os.stat(store.inside(out, rel)).st_nlink > 1
            except (OSError, store.UnsafePathError):
                continue
            if linked and e.get("shard") is not None:
                shards.add(int(e["shard"]))
    return sorted(shards)
