"""Deterministic shards of one global plan: `hsx extract --shard I/N`.

Every node reads the same inputs and plans the same global sample list (read, shuffle with
the seed, cut to max_samples: `hsx_client.extract` does this whether sharded or not), then
keeps shard I of it: the contiguous slice `[I*n//N, (I+1)*n//N)`. Contiguous slices keep
the global order when the shards are concatenated by `hsx merge` (a merged corpus is then
row for row what one client would have written), and sizes differ by at most one sample
(the list is shuffled, so lengths are balanced too).

Each shard is an ordinary crash-safe corpus directory whose plan.json also holds

    "shard": {"index", "count", "start", "stop", "global_samples",
              "global_keys_sha256", "global_fingerprint"}

`global_keys_sha256` hashes the whole global key list; `global_fingerprint` hashes it with
the settings, the inputs' fingerprint and the model. `hsx merge` proves with them that the
shards come from one plan and cover it exactly once (the concatenated shard keys must
hash to `global_keys_sha256`).

Where I and N come from (first match wins):
  --shard I/N                                        (or --shard I with --num-shards N)
  JOB_COMPLETION_INDEX (Kubernetes Indexed Job)      with --num-shards / HSX_NUM_SHARDS
  SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN (divided by SLURM_ARRAY_TASK_STEP)
                                                     with --num-shards / HSX_NUM_SHARDS,
                                                     else SLURM_ARRAY_TASK_COUNT
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ShardError(ValueError):
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


def _int(name: str, value: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ShardError(f"{name} must be an integer, got {value!r}") from None


def resolve(shard: str | None, num_shards: int | str | None, env: Mapping[str, str]) -> ShardSpec | None:
    """The shard this process extracts, from the flags, else the scheduler's environment;
    None when nothing asks for sharding."""
    count = None if num_shards in (None, "") else _int("--num-shards", num_shards)
    if count is None and env.get("HSX_NUM_SHARDS"):
        count = _int("HSX_NUM_SHARDS", env["HSX_NUM_SHARDS"])
    if shard:
        idx, sep, n = str(shard).partition("/")
        index = _int("--shard", idx)
        if sep:
            n_given = _int("--shard", n)
            if count is not None and count != n_given:
                raise ShardError(f"--shard {shard} says {n_given} shards, --num-shards/HSX_NUM_SHARDS says {count}")
            count = n_given
        if count is None:
            raise ShardError(f"--shard {shard}: give the count as --shard I/N or --num-shards N")
        return ShardSpec(index, count)
    if env.get("JOB_COMPLETION_INDEX", "") != "":
        index = _int("JOB_COMPLETION_INDEX", env["JOB_COMPLETION_INDEX"])
        if count is None:
            raise ShardError(
                f"JOB_COMPLETION_INDEX={index} (a Kubernetes Indexed Job) but no shard count: set HSX_NUM_SHARDS "
                "(or --num-shards) to the Job's completions"
            )
        return ShardSpec(index, count)
    if env.get("SLURM_ARRAY_TASK_ID", "") != "":
        task = _int("SLURM_ARRAY_TASK_ID", env["SLURM_ARRAY_TASK_ID"])
        first = _int("SLURM_ARRAY_TASK_MIN", env.get("SLURM_ARRAY_TASK_MIN") or 0)
        step = _int("SLURM_ARRAY_TASK_STEP", env.get("SLURM_ARRAY_TASK_STEP") or 1)
        if step < 1 or (task - first) % step:
            raise ShardError(f"SLURM_ARRAY_TASK_ID={task} is not on the array's grid (min {first}, step {step})")
        if count is None and env.get("SLURM_ARRAY_TASK_COUNT"):
            count = _int("SLURM_ARRAY_TASK_COUNT", env["SLURM_ARRAY_TASK_COUNT"])
        if count is None:
            raise ShardError(f"SLURM_ARRAY_TASK_ID={task} but no shard count: set HSX_NUM_SHARDS or --num-shards")
        return ShardSpec((task - first) // step, count)
    return None


# ---------------------------------------------------------------- plan
def keys_digest(keys: list[str]) -> str:
    h = hashlib.sha256()
    for k in keys:
        h.update(k.encode())
        h.update(b"\n")
    return h.hexdigest()


def fingerprint(keys_sha256: str, num_samples: int, settings: Mapping[str, Any], inputs_sha256: str,
                model: Any, model_revision: Any) -> str:
    """What makes two global plans the same: the key list, the settings, the inputs, the model."""
    doc = {"keys_sha256": keys_sha256, "num_samples": num_samples, "settings": dict(settings),
           "inputs_sha256": inputs_sha256, "model": model, "model_revision": model_revision}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def bounds(spec: ShardSpec, n: int) -> tuple[int, int]:
    return spec.index * n // spec.count, (spec.index + 1) * n // spec.count


def take(keys: list[str], spec: ShardSpec | None, *, settings: Mapping[str, Any], inputs_sha256: str,
         model: Any, model_revision: Any) -> tuple[list[str], dict[str, Any] | None]:
    """(this shard's keys, the plan's "shard" section) from the global key list."""
    if spec is None:
        return keys, None
    n = len(keys)
    if n < spec.count:
        raise ShardError(f"--shard {spec}: the global plan holds {n} sample(s), fewer than {spec.count} shards; "
                         f"use at most {n} shards")
    start, stop = bounds(spec, n)
    digest = keys_digest(keys)
    return keys[start:stop], {
        "index": spec.index,
        "count": spec.count,
        "start": start,
        "stop": stop,
        "global_samples": n,
        "global_keys_sha256": digest,
        "global_fingerprint": fingerprint(digest, n, settings, inputs_sha256, model, model_revision),
    }


def resume_problems(plan: Mapping[str, Any], spec: ShardSpec | None) -> list[str]:
    """Why an existing plan cannot be continued as `spec` (empty: it can)."""
    if plan.get("merge"):
        return ["it is a merged corpus (hsx merge) and takes no more samples; extract into a new --output"]
    saved = plan.get("shard")
    if spec is None or (saved and (saved["index"], saved["count"]) == (spec.index, spec.count)):
        return []
    if not saved:
        return [f"shard: the plan is not sharded, this run asks for shard {spec}"]
    return [f"shard: the plan is shard {saved['index']}/{saved['count']}, this run asks for {spec}"]
