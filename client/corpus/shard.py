"""Which shard this process extracts (`hsx extract --shard I/N`): from the flags, else the
scheduler's environment. What a shard is, and how it is cut from the global plan, is
hsx_client.corpus.plan's ("Shards").

Where I and N come from (first match wins):
  --shard I/N                                        (or --shard I with --num-shards N)
  JOB_COMPLETION_INDEX (Kubernetes Indexed Job)      with --num-shards / HSX_NUM_SHARDS
  SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN (divided by SLURM_ARRAY_TASK_STEP)
                                                     with --num-shards / HSX_NUM_SHARDS,
                                                     else SLURM_ARRAY_TASK_COUNT
"""

from __future__ import annotations

from collections.abc import Mapping

from hsx_client.corpus.plan import ShardError, ShardSpec


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


__all__ = ["ShardError", "ShardSpec", "resolve"]
