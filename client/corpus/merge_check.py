"""The shards `hsx merge` is given: read each one, and every reason to refuse them.

A shard is accepted when it is a finished corpus of a sharded run (`hsx extract --shard`):
plan.json with a "shard" section, hsx_corpus.json present (finalize ran), no pending
`hsx verify` findings, and a manifest that accounts for every planned sample. The shards
together must be one run: the same shard count, every index 0..N-1 exactly once, one
global plan (fingerprint), and the same corpus settings (every field of hsx_corpus.json and
hsx_format.json except the per-shard ones below: model, revision, layers, chat template,
max length, format, mask policy, dtype, vocab, and whatever a newer writer adds, so corpora
of different kinds are never mixed). Last, their keys laid end to end must be the global
key list (its hash is in every shard's plan): each planned sample is in exactly one shard.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx_client.corpus import plan as planning
from hsx_client.corpus import journal, store
from hsx_client.corpus.formats import FORMAT_FILE
from hsx_client.corpus.plan import ConfigError, failed_for_good, load_plan
from hsx_client.corpus.verify import compaction_moves

# hsx_corpus.json fields that describe one shard's run rather than the corpus settings:
# facts about its own samples (counts, the indices it failed or dropped, in its own
# numbering) are combined by the merge (hsx_client.corpus.merge), never compared. A shard that
# dropped a sample (no supervised token after truncation) differs from the others there
# as a matter of course.
PER_SHARD_CORPUS_FIELDS = frozenset(
    {"created_at", "counts", "failed_indices", "dropped_indices", "finalize_files", "inputs", "versions", "shard"}
)
# hsx_format.json fields that are counts of one shard's samples.
PER_SHARD_FORMAT_FIELDS = frozenset({"compacted_moves", "compaction_journal", "orphans_quarantined"})


class MergeError(Exception):
    """The merge stopped (a shard file missing or corrupt, a disk error): exit 1, resumable."""


class MergeRefused(Exception):
    """The shards cannot be merged as given (exit 2); one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class Shard:
    path: Path
    plan: dict[str, Any]
    corpus: dict[str, Any]
    format_doc: dict[str, Any]
    done: dict[int, dict[str, Any]]  # manifest index -> its (last) manifest line
    failed: dict[int, dict[str, Any]]
    moves: dict[int, int] = field(default_factory=dict)  # finalize's renumbering (speculators)
    plan_sha256: str = ""
    corpus_sha256: str = ""
    manifest_bytes: int = 0  # manifest.jsonl's length: it grows with every sample redone

    @property
    def section(self) -> dict[str, Any]:
        return self.plan["shard"]

    @property
    def index(self) -> int:
        return int(self.section["index"])

    @property
    def count(self) -> int:
        return int(self.section["count"])

    @property
    def name(self) -> str:
        return f"shard {self.index}/{self.count} ({self.path})"


def _sha256(path: Path) -> str:
    return store.hash_file(path, algo="sha256")[1]  # small files; the record names SHA-256


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= 70 else s[:67] + "..."


def load_shard(path: Path) -> tuple[Shard | None, list[str]]:
    """(the shard, []) or (None, [why it cannot be merged])."""
    path = Path(path)
    if not path.is_dir():
        return None, [f"{path}: no such directory"]
    try:
        plan = load_plan(path)
    except (ConfigError, ValueError) as exc:
        return None, [f"{path}: unreadable plan.json ({exc})"]
    if plan is None:
        return None, [f"{path} is not an hsx corpus (no {store.PLAN_NAME})"]
    if plan.get("merge"):
        return None, [f"{path} is a merged corpus, not a shard: merge the shards it was made from"]
    if not plan.get("shard"):
        return None, [f"{path} was extracted without --shard: only the shards of one sharded run can be merged"]
    name = f"shard {plan['shard']['index']}/{plan['shard']['count']} ({path})"
    corpus_path = path / store.CORPUS_NAME
    if not corpus_path.exists():
        return None, [f"{name} is not finalized (no {store.CORPUS_NAME}): rerun its `hsx extract --output {path}` "
                      "to finish it"]
    if (path / store.VERIFY_NAME).exists():
        return None, [f"{name} has samples `hsx verify` found bad ({store.VERIFY_NAME}): rerun its hsx extract to "
                      "redo them first"]
    try:
        corpus = json.loads(corpus_path.read_text())
        fmt_path = path / FORMAT_FILE
        format_doc = json.loads(fmt_path.read_text()) if fmt_path.exists() else {}
    except ValueError as exc:
        return None, [f"{name}: unreadable {store.CORPUS_NAME} or {FORMAT_FILE} ({exc})"]
    keys = plan["keys"]
    n = len(keys)
    entries, _, _ = journal.read_jsonl(path / store.MANIFEST_NAME)
    done = journal.latest_by_index(entries)
    failed = failed_for_good(path, n, done)
    counts = corpus.get("counts", {})
    problems = []
    if len(done) + len(failed) != n or counts.get("done") != len(done) or counts.get("planned") != n:
        problems.append(
            f"{name} is incomplete: its manifest holds {len(done)} done + {len(failed)} failed of {n} planned, "
            f"{store.CORPUS_NAME} says {counts.get('done')} done of {counts.get('planned')}: rerun its hsx extract"
        )
    wrong = [i for i, e in done.items() if i >= n or e.get("key") != keys[i]]
    if wrong:
        problems.append(f"{name}: manifest lines {wrong[:5]} do not match its plan's keys")
    if problems:
        return None, problems
    return Shard(
        path=path, plan=plan, corpus=corpus, format_doc=format_doc, done=done, failed=failed,
        moves=compaction_moves(path), plan_sha256=_sha256(path / store.PLAN_NAME),
        corpus_sha256=_sha256(corpus_path), manifest_bytes=os.path.getsize(path / store.MANIFEST_NAME),
    ), []


def _disagreements(shards: list[Shard], what: str, docs: list[dict[str, Any]], skip) -> list[str]:
    problems = []
    first, ref = shards[0], docs[0]
    for sh, doc in zip(shards[1:], docs[1:]):
        for key in sorted(set(ref) | set(doc)):
            if skip(key):
                continue
            if ref.get(key) != doc.get(key):
                problems.append(f"{sh.name} disagrees with {first.name} on {key} ({what}): "
                                f"{_short(doc.get(key))} vs {_short(ref.get(key))}")
    return problems


def check_together(shards: list[Shard]) -> list[str]:
    """Why these shards are not one complete run (empty: they are). `shards` is sorted by index."""
    problems: list[str] = []
    counts = sorted({sh.count for sh in shards})
    if len(counts) > 1:
        problems.append("the shards come from runs of different sizes: " +
                        ", ".join(f"{sh.path} is {sh.index}/{sh.count}" for sh in shards))
        return problems
    n_shards = counts[0]
    by_index: dict[int, Shard] = {}
    for sh in shards:
        if sh.index in by_index:
            problems.append(f"shard {sh.index}/{n_shards} is given twice: {by_index[sh.index].path} and {sh.path}")
        by_index.setdefault(sh.index, sh)
    missing = [i for i in range(n_shards) if i not in by_index]
    if missing:
        problems.append(f"shard(s) {', '.join(map(str, missing))} of {n_shards} are missing "
                        f"(given: {', '.join(map(str, sorted(by_index)))})")
    prints = {sh.section["global_fingerprint"] for sh in shards}
    if len(prints) > 1:
        problems.append("the shards come from different global plans (inputs, seed, --max-samples, settings or "
                        "model differ): " + ", ".join(f"{sh.path}: {sh.section['global_fingerprint'][:12]}"
                                                      for sh in shards))
    problems += _disagreements(shards, store.CORPUS_NAME, [sh.corpus for sh in shards],
                               lambda k: k in PER_SHARD_CORPUS_FIELDS)
    problems += _disagreements(shards, FORMAT_FILE, [sh.format_doc for sh in shards],
                               lambda k: k in PER_SHARD_FORMAT_FIELDS or k.startswith("num_"))
    if problems:
        return problems
    # One plan, all indices once: now the keys must lay out the global list exactly.
    n = int(shards[0].section["global_samples"])
    pos = 0
    for sh in shards:
        sec = sh.section
        if (sec["start"], sec["stop"]) != planning.shard_bounds(planning.ShardSpec(sh.index, n_shards), n) \
                or sec["start"] != pos or len(sh.plan["keys"]) != sec["stop"] - sec["start"]:
            problems.append(f"{sh.name} holds samples {sec['start']}..{sec['stop']} ({len(sh.plan['keys'])} keys), "
                            f"not its slice of the {n}-sample global plan")
        pos = sec["stop"]
    keys = [k for sh in shards for k in sh.plan["keys"]]
    sec0, plan0 = shards[0].section, shards[0].plan
    if planning.keys_digest(keys) != sec0["global_keys_sha256"] or len(keys) != n:
        problems.append("the shards' keys laid end to end are not their global plan's keys (a plan.json was edited, "
                        "or comes from another run)")
    elif planning.global_fingerprint(sec0["global_keys_sha256"], n, plan0["settings"], plan0["inputs_sha256"],
                              plan0.get("model"), plan0.get("model_revision")) != sec0["global_fingerprint"]:
        problems.append("the shards' global fingerprint does not match their plan's settings (a plan.json was edited)")
    return problems


def load_all(out: Path, paths: list[Path]) -> list[Shard]:
    """Every shard, sorted by index; raises MergeRefused with every problem found."""
    problems: list[str] = []
    out_real = os.path.realpath(out)
    seen: dict[str, Path] = {}
    shards = []
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            problems.append(f"{p} is given twice")
            continue
        seen[real] = Path(p)
        if real == out_real or out_real.startswith(real + os.sep):
            problems.append(f"the output {out} lies in the shard {p}: pick an output outside every shard")
            continue
        if real.startswith(out_real + os.sep):
            problems.append(f"the shard {p} lies inside the output {out} (SpecForge reads every *.ckpt under it): "
                            "pick an output beside the shards")
            continue
        sh, why = load_shard(Path(p))
        problems += why
        if sh is not None:
            shards.append(sh)
    if not problems and not shards:
        problems.append("no shard given")
    if not problems:
        shards.sort(key=lambda s: s.index)
        problems += check_together(shards)
    if problems:
        raise MergeRefused(problems)
    return shards
