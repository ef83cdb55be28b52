"""The plan of a corpus run, and what of it is still to do.

The plan (`plan.json`, written before any extraction): the settings that shape the corpus
and the key of every planned sample by final index. On a new dir the sample keys are
shuffled with `--seed` (unless `--no-shuffle`) and cut to `--max-samples`. On an existing
dir the saved plan is reused as it is: a flag given with a value different from the
plan's is refused, naming the setting; a flag left out takes the plan's value (so
`hsx extract --resume --output DIR --server URL` is enough).

What is done: the manifest (last line per index wins), minus samples whose files are
missing or have another size than recorded, minus those `hsx verify` listed in
`verify.json` (turned into manifest "invalid" lines, then the file removed), minus all
that fail the full check when `--verify` is given. What is to do: every planned index
neither done nor failed for good (`pending`).

Shards (`hsx extract --shard I/N`; hsx_client.corpus.shard says where I and N come from): every
node plans the same global sample list as above, then keeps shard I of it, the contiguous
slice `[I*n//N, (I+1)*n//N)`. Contiguous slices keep the global order when `hsx merge`
concatenates the shards (a merged corpus is then row for row what one client would have
written), and sizes differ by at most one sample. A shard's plan.json also holds

    "shard": {"index", "count", "start", "stop", "global_samples",
              "global_keys_sha256", "global_fingerprint"}

`global_keys_sha256` hashes the whole global key list; `global_fingerprint` hashes it with
the settings, the inputs' fingerprint and the model. `hsx merge` proves with them that the
shards come from one plan and cover it exactly once.

`--max-length` left out on a new dir: the smallest `max_tokens_per_request` of the
servers (what they would accept at all), recorded in the plan like a given value; rows
longer than that are cut by `--truncation` (default right) instead of failing with 413.

Not every planned sample ends in the corpus: failed.jsonl holds those that failed (kinds
below) and those *dropped* by policy (kind "dropped": after truncation no token is
supervised, so the row has nothing to train on, shared/DESIGN.md). Dropped rows are not
failures: they do not make the exit status non-zero and are never retried. The disk estimate
is hsx_client.corpus.disk_estimate's.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_client.corpus import journal, store
from hsx_client.corpus.settings import ConfigError, CorpusSettings  # noqa: F401 (ConfigError: settings.py's, named here too)

PLAN_VERSION = 1

# Failures the next run retries by itself (the others only with --retry-failed).
RETRIED_KINDS = ("server_error", "lease_expired")  # lease_expired: failed.jsonl of earlier versions
DROPPED = "dropped"  # not stored by policy (no supervised token): not a failure, never retried


class ShardError(ConfigError):
    """The shard cannot be chosen or does not fit the plan (exit 2)."""


@dataclass(frozen=True)
class ShardSpec:
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ShardError(f"the shard count must be at least 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ShardError(f"shard index {self.index} is outside 0..{self.count - 1} ({self.count} shards)")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


# ---------------------------------------------------------------- the plan
def load_plan(out: Path) -> dict[str, Any] | None:
    p = Path(out) / store.PLAN_NAME
    if not p.exists():
        return None
    with open(p) as f:
        plan = json.load(f)
    if plan.get("version") != PLAN_VERSION:
        raise ConfigError(f"{p} has plan version {plan.get('version')}, this client writes {PLAN_VERSION}")
    return plan


def servers_max_tokens(infos: Iterable[dict[str, Any]]) -> int | None:
    """The largest prompt every server takes: the smallest `max_tokens_per_request`."""
    limits = []
    for info in infos:
        lim = info.get("max_tokens_per_request")
        if lim is None and info.get("max_model_len"):
            lim = int(info["max_model_len"]) - 1
        if lim:
            limits.append(int(lim))
    return min(limits) if limits else None


def served_layers(asked: list[int] | None, info: dict[str, Any]) -> list[int]:
    """The run's layers: those asked (each must be served), else all the server serves."""
    served = [int(x) for x in info["layer_ids"]]
    if asked is None:
        return served
    layers = sorted(int(x) for x in asked)
    missing = [x for x in layers if x not in served]
    if missing:
        raise ConfigError(f"--layers {layers}: the server serves layers {served}, not {missing}")
    return layers


def inputs_fingerprint(samples: list[Any]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.key.encode())
        h.update(b"\0")
        h.update(json.dumps(s.request, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def input_files(inputs: list[str]) -> list[dict[str, Any]]:
    """Size and checksum of every local file the inputs name (a directory's files, sorted;
    `hf:` datasets have none). The plan keeps them, and every later run on the dir compares
    them: the samples' fingerprint alone misses an edit of a field no request uses."""
    files: list[dict[str, Any]] = []
    for spec in inputs:
        if os.path.isfile(spec):
            paths = [spec]
        elif os.path.isdir(spec):
            # hidden files and datasets' cache files are not the data: tools write them as they read
            paths = sorted(str(p) for p in Path(spec).rglob("*") if p.is_file() and not p.name.startswith("cache-")
                           and not any(part.startswith(".") for part in p.relative_to(spec).parts))
        else:
            continue
        for path in paths:
            size, digest = store.hash_file(Path(path))
            files.append({"path": os.path.abspath(path), "size": size, store.HASH_ALGO: digest})
    return files


def changed_inputs(recorded: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[str]:
    """One line per input file that is not as the plan recorded it; none when the same
    contents are read from other paths (a volume mounted elsewhere on resume)."""
    def contents(files: list[dict[str, Any]]) -> list[tuple[int, Any]]:
        return sorted((f["size"], store.recorded_digest(f)) for f in files)

    if contents(recorded) == contents(now):
        return []
    was = {f["path"]: f for f in recorded}
    cur = {f["path"]: f for f in now}
    lines = []
    for path in sorted(set(was) | set(cur)):
        a, b = was.get(path), cur.get(path)
        if b is None:
            lines.append(f"{path} is gone (the plan read {a['size']} bytes from it)")
        elif a is None:
            lines.append(f"{path} is new (not among the plan's inputs)")
        elif a["size"] != b["size"]:
            lines.append(f"{path} changed: {a['size']} bytes when planned, {b['size']} now")
        elif store.recorded_digest(a) != store.recorded_digest(b):
            lines.append(f"{path} changed: same size ({b['size']} bytes), other content")
    return lines


def normalize_input(path: str) -> str:
    return os.path.abspath(path) if os.path.exists(path) else path


@dataclass
class Samples:
    """What the inputs hold: the samples by key, their fingerprint, the rows skipped
    (`bad`: {"source": file:line, "kind", "reason"} each)."""

    by_key: dict[str, Any]
    fingerprint: str
    count: int
    bad: list[dict[str, str]]

    @property
    def bad_rows(self) -> int:
        return len(self.bad)

    @classmethod
    def read(cls, read_samples: Callable[..., list[Any]], inputs: list[str], mask_policy: str) -> "Samples":
        bad_rows: list[Any] = []
        try:
            samples = read_samples(inputs, mask_policy=mask_policy, bad_rows=bad_rows)
        except FileNotFoundError as exc:
            raise ConfigError(f"--input: {exc.args[0] if exc.args else exc}") from None
        except (OSError, ValueError, RuntimeError) as exc:  # unreadable file, bad dataset dir, hub down
            raise ConfigError(f"--input: {exc}") from None
        by_key = {s.key: s for s in samples}
        if len(by_key) != len(samples):
            raise ConfigError("the inputs produced duplicate sample keys")
        bad = [_bad_row(b) for b in bad_rows]
        if not samples:
            raise ConfigError(no_usable_rows(inputs, bad))
        return cls(by_key, inputs_fingerprint(samples), len(samples), bad)


def _bad_row(b: Any) -> dict[str, str]:
    if isinstance(b, (tuple, list)):  # (path, line, reason), as simple readers give them
        return {"source": ":".join(str(x) for x in b[:-1]), "kind": "malformed", "reason": str(b[-1])}
    return {"source": str(getattr(b, "source", "?")), "kind": str(getattr(b, "kind", "malformed")),
            "reason": str(getattr(b, "reason", b))}


def bad_row_counts(bad: list[dict[str, str]]) -> list[tuple[str, int]]:
    """(kind, count), most frequent first."""
    counts: dict[str, int] = {}
    for b in bad:
        counts[b["kind"]] = counts.get(b["kind"], 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


_KIND_TEXT = {
    "no_assistant_turn": "have no assistant turn (nothing to supervise)",
    "question_only": "have no assistant turn (questions only; pair them with answers, e.g. "
                     "--input question.jsonl --input <model>-answers.jsonl for MT-Bench)",
    "invalid_json": "are not valid JSON",
    "not_utf8": "are not UTF-8",
    "unknown_shape": "have an unknown shape (not messages, conversations, Alpaca, MT-Bench, prompt/text "
                     "or input_ids)",
    "malformed": "are malformed",
}


def no_usable_rows(inputs: list[str], bad: list[dict[str, str]]) -> str:
    names = ", ".join(os.path.basename(os.path.normpath(p)) for p in inputs)
    if not bad:
        return f"no usable rows in {names}: the input is empty"
    parts = [f"{n} row{'s' if n != 1 else ''} {_KIND_TEXT.get(k, k)}" for k, n in bad_row_counts(bad)]
    first = bad[0]
    return f"no usable rows in {names}: {'; '.join(parts)} (first: {first['source']}: {first['reason']})"


def new_plan(settings: CorpusSettings, inputs: list[str], samples: Samples, info: dict[str, Any],
             shard: ShardSpec | None = None) -> dict[str, Any]:
    keys = list(samples.by_key)
    if settings.shuffle:
        random.Random(settings.seed).shuffle(keys)
    if settings.max_samples is not None:
        keys = keys[: settings.max_samples]
    keys, section = take_shard(keys, shard, settings=settings.to_saved(), inputs_sha256=samples.fingerprint,
                               model=info.get("model"), model_revision=info.get("model_revision"))
    plan = {
        "version": PLAN_VERSION,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": settings.to_saved(),
        "inputs": inputs,
        "inputs_sha256": samples.fingerprint,
        "input_files": input_files(inputs),
        "num_input_samples": samples.count,
        "bad_rows": samples.bad_rows,
        "bad_row_kinds": dict(bad_row_counts(samples.bad)),
        "model": info.get("model"),
        "model_revision": info.get("model_revision"),
        "keys": keys,
    }
    if section:
        plan["shard"] = section
    return plan


def check_resumable(plan: dict[str, Any], inputs: list[str], samples: Samples, info: dict[str, Any],
                    layers: list[int], out: Path, shard: ShardSpec | None = None) -> None:
    problems = []
    changed = changed_inputs(plan["input_files"], input_files(inputs)) if "input_files" in plan else []
    if changed:  # checked on every run, a finished corpus too: it was made from the files as they were
        same = plan.get("inputs_sha256") == samples.fingerprint
        problems += [f"input {line}" for line in changed]
        problems.append(
            ("the samples read from them are still the plan's (only fields no request uses changed), but "
             if same else f"the samples read from them differ from the plan's ({plan.get('num_input_samples')} "
                          f"then, {samples.count} now); ")
            + "the corpus was made from the files as they were: restore them, or extract into a new --output"
        )
    elif plan.get("inputs_sha256") != samples.fingerprint:
        problems.append(
            f"the inputs differ from the plan's ({plan.get('num_input_samples')} samples from "
            f"{plan.get('inputs')}, now {samples.count} from {inputs}); restore them, or extract into a new --output"
        )
    for k in ("model", "model_revision"):
        if plan.get(k) != info.get(k):
            problems.append(f"{k}: the plan has {plan.get(k)!r}, the server has {info.get(k)!r}")
    if plan["settings"].get("layers") != layers:
        problems.append(f"layers: the plan has {plan['settings'].get('layers')}, now {layers}")
    problems += shard_resume_problems(plan, shard)
    if problems:
        raise ConfigError(f"cannot resume {out}:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------- shards
def keys_digest(keys: list[str]) -> str:
    h = hashlib.sha256()
    for k in keys:
        h.update(k.encode())
        h.update(b"\n")
    return h.hexdigest()


def global_fingerprint(keys_sha256: str, num_samples: int, settings: dict[str, Any], inputs_sha256: str,
                       model: Any, model_revision: Any) -> str:
    """What makes two global plans the same: the key list, the settings, the inputs, the model."""
    doc = {"keys_sha256": keys_sha256, "num_samples": num_samples, "settings": dict(settings),
           "inputs_sha256": inputs_sha256, "model": model, "model_revision": model_revision}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_bounds(spec: ShardSpec, n: int) -> tuple[int, int]:
    return spec.index * n // spec.count, (spec.index + 1) * n // spec.count


def take_shard(keys: list[str], spec: ShardSpec | None, *, settings: dict[str, Any], inputs_sha256: str,
               model: Any, model_revision: Any) -> tuple[list[str], dict[str, Any] | None]:
    """(this shard's keys, the plan's "shard" section) from the global key list."""
    if spec is None:
        return keys, None
    n = len(keys)
    if n < spec.count:
        raise ShardError(f"--shard {spec}: the global plan holds {n} sample(s), fewer than {spec.count} shards; "
                         f"use at most {n} shards")
    start, stop = shard_bounds(spec, n)
    digest = keys_digest(keys)
    return keys[start:stop], {
        "index": spec.index,
        "count": spec.count,
        "start": start,
        "stop": stop,
        "global_samples": n,
        "global_keys_sha256": digest,
        "global_fingerprint": global_fingerprint(digest, n, settings, inputs_sha256, model, model_revision),
    }


def shard_resume_problems(plan: dict[str, Any], spec: ShardSpec | None) -> list[str]:
    """Why an existing plan cannot be continued as `spec` (empty: it can)."""
    if plan.get("merge"):  # repaired in place (hsx_client.corpus.merged), never continued as a shard
        return [] if spec is None else [f"it is a merged corpus (hsx merge), not shard {spec}: repair it without "
                                        "--shard, or extract the shard into a new --output"]
    saved = plan.get("shard")
    if spec is None or (saved and (saved["index"], saved["count"]) == (spec.index, spec.count)):
        return []
    if not saved:
        return [f"shard: the plan is not sharded, this run asks for shard {spec}"]
    return [f"shard: the plan is shard {saved['index']}/{saved['count']}, this run asks for {spec}"]


# ---------------------------------------------------------------- what is done
def load_failed(out: Path) -> dict[int, dict[str, Any]]:
    entries, _, _ = journal.read_jsonl(Path(out) / store.FAILED_NAME)
    return {int(e["index"]): e for e in entries if "index" in e}


def failed_for_good(out: Path, n: int, done: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The failed.jsonl entries of planned indices that are not done (dropped ones included)."""
    return {i: e for i, e in load_failed(out).items() if i not in done and i < n}


def split_dropped(failed: dict[int, dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """(failures, dropped by policy)."""
    dropped = {i: e for i, e in failed.items() if e.get("kind") == DROPPED}
    return {i: e for i, e in failed.items() if i not in dropped}, dropped


def refuse_changes_after_compaction(out: Path, retry_failed: bool) -> None:
    """finalize renumbered the samples (a format without holes): the set of stored samples
    is fixed, so failed samples cannot be added any more. Bad samples (`hsx verify`,
    `--verify`) are still redone in place: each is extracted again under its plan index,
    and the rerun finalize moves it to its renumbered place as the journal says."""
    if retry_failed:
        raise ConfigError(
            f"{out} was finalized with renumbering ({store.COMPACTION_JOURNAL}); --retry-failed would add "
            "samples and renumber it again: extract into a new --output"
        )


def repairing(entries: Iterable[dict[str, Any]], done: dict[int, dict[str, Any]]) -> set[int]:
    """Indices invalidated (verify found them bad) and not stored again since."""
    return {int(e["index"]) for e in entries if e.get("invalid") and "index" in e} - set(done)


def invalidate(manifest: journal.JsonlLog, done: dict[int, dict[str, Any]], bad: Iterable[dict[str, Any]]) -> int:
    """Append an "invalid" line for each bad sample that is done; returns how many."""
    n = 0
    for b in bad:
        i = int(b["index"])
        if i in done:
            manifest.append({"index": i, "key": b.get("key"), "invalid": True, "reason": b.get("problems")})
            del done[i]
            n += 1
    return n


def invalidate_from_verify(out: Path, manifest: journal.JsonlLog, done: dict[int, dict[str, Any]]) -> int:
    """The samples `hsx verify` found bad (verify.json) are redone; the file goes."""
    p = out / store.VERIFY_NAME
    if not p.exists():
        return 0
    try:
        bad = json.loads(p.read_text()).get("bad", [])
    except ValueError:
        bad = []
    n = invalidate(manifest, done, bad)
    p.unlink()
    store.fsync_dir(out)
    return n


def drop_broken(out: Path, keys: list[str], done: dict[int, dict[str, Any]], check_sizes: bool) -> int:
    """Refuse manifest lines that are not the plan's; forget samples whose files are
    missing or of another size (they are redone). Returns how many were forgotten."""
    redo = 0
    for i, e in list(done.items()):
        if i >= len(keys) or e.get("key") != keys[i]:
            raise ConfigError(f"manifest line for index {i} does not match the plan (key {e.get('key')!r})")
        outside = store.unsafe_paths(out, e)
        if outside:  # an edited manifest: never read, replace or link a file elsewhere
            raise ConfigError(f"manifest line for index {i} names a file outside {out}: {outside[0]}; restore "
                              f"{store.MANIFEST_NAME} or extract into a new --output")
        if check_sizes and store.check_sizes(out, e):
            del done[i]
            redo += 1
    return redo


def pending(n: int, done: dict[int, Any], failed: dict[int, Any],
            select: Callable[[int], bool] | None = None) -> list[int]:
    """The planned indices still to do, in plan order; `select` keeps a part of them."""
    return [i for i in range(n) if i not in done and i not in failed and (select is None or select(i))]
