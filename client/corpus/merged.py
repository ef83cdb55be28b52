"""A merged corpus (`hsx merge`) repaired in place: `hsx extract --output MERGED --server URL`.

A merged corpus's plan holds its stored samples only (renumbered 0..m-1), so its set of
samples is fixed: a repair redoes exactly the samples `hsx verify` found bad (verify.json)
or whose files are missing, from the servers, under their merged index, with the plan's
settings. Nothing is added or renumbered; a sample whose repair fails is retried by the
next run and the corpus stays unfinished until every one is back.

Its hsx_corpus.json is the merge's record (the shards, the samples they failed or dropped),
which cannot be rebuilt from the plan once the shards are gone. While a repair runs it is
kept aside as REPAIRING_NAME (one rename: hsx_corpus.json still marks a finished corpus
alone), and the repair's finalize writes it back with its finalize files and counts.

Copy-on-repair: merged sample files are hard links into the shards. Every hsx writer
writes a new file under a temporary name and renames it over the old name (store), so a
repaired file replaces the merged corpus's link and the shard keeps its own file untouched.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hsx import __version__ as hsx_version

from hsx_client.corpus import store
from hsx_client.corpus.provenance import files_digest
from hsx_client.corpus.settings import ConfigError

REPAIRING_NAME = "hsx_corpus.repairing.json"


class UnfinishedRepair(ValueError):
    """A merged corpus whose repair cannot be finalized yet (exit 1: rerun to retry)."""


def is_merged(plan: dict[str, Any] | None) -> bool:
    return bool(plan and plan.get("merge"))


def record(out: Path) -> dict[str, Any] | None:
    """The merge's record: hsx_corpus.json, or the copy a repair keeps aside (None: neither)."""
    for name in (store.CORPUS_NAME, REPAIRING_NAME):
        p = Path(out) / name
        if p.exists():
            return json.loads(p.read_text())
    return None


def check_repairable(out: Path, retry_failed: bool) -> None:
    """Refuse what a merged corpus cannot take; tidy a repair's leftover (finished just before a kill)."""
    out = Path(out)
    if retry_failed:
        raise ConfigError(f"{out} is a merged corpus: it holds no failed sample of its own; retry them in their "
                          "shards (hsx extract --retry-failed --output SHARD), then rerun `hsx merge` into a new "
                          "output")
    corpus, aside = out / store.CORPUS_NAME, out / REPAIRING_NAME
    if corpus.exists() and aside.exists():
        aside.unlink()
        store.fsync_dir(out)
    elif not corpus.exists() and not aside.exists():
        raise ConfigError(f"{out} is an unfinished merge (no {store.CORPUS_NAME}): rerun the same `hsx merge "
                          f"{out} SHARD...` to finish it")


def set_aside(out: Path) -> None:
    """The corpus is about to change: no longer finished; its record kept for `finish`."""
    corpus = Path(out) / store.CORPUS_NAME
    if corpus.exists():
        os.replace(corpus, Path(out) / REPAIRING_NAME)
        store.fsync_dir(Path(out))


def finish(out: Path, fmt: Any, ctx: Any, n: int, done: dict[int, dict[str, Any]],
           not_stored: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The format's finalize over every sample again, then hsx_corpus.json: the merge's
    record with this repair's finalize files and counts. UnfinishedRepair while a
    planned sample is not back (its repair failed): the merged corpus never shrinks."""
    out = Path(out)
    missing = sorted(set(range(n)) - set(done))
    if missing:
        reasons = sorted({str(not_stored[i].get("kind")) for i in missing if i in not_stored})
        raise UnfinishedRepair(
            f"{len(missing)} sample(s) of the merged corpus could not be extracted again (first: {missing[:5]}"
            + (f"; {', '.join(reasons)}" if reasons else "") + "): the corpus stays unfinished; fix the cause "
            "and rerun, or repair the shards and rerun `hsx merge` into a new output")
    doc = record(out)
    if doc is None:  # check_repairable refused this before any work
        raise UnfinishedRepair(f"{out} lost its merge record ({store.CORPUS_NAME})")
    written = list(fmt.finalize(out, sorted((i, e["record"]) for i, e in done.items()), ctx) or [])
    for rel in written:
        store.fsync_dir((out / rel).parent)
    counts = dict(doc.get("counts") or {})
    counts.update(planned=n, done=len(done), tokens=sum(int(e.get("tokens", 0)) for e in done.values()),
                  truncated=sum(1 for e in done.values() if e.get("truncated_from")))
    repairs = [*doc.get("repairs", []), {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hsx_client": hsx_version}]
    doc.update(counts=counts, finalize_files=files_digest(out, written), repairs=repairs)
    store.write_json_atomic(out / store.CORPUS_NAME, doc)
    try:
        (out / REPAIRING_NAME).unlink()
    except FileNotFoundError:
        pass
    store.fsync_dir(out)
    return doc
