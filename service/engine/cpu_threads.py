"""Thread binding of vLLM's CPU workers when one engine runs several ranks (TP > 1).

vLLM's CPU backend binds each rank's OpenMP threads to one NUMA node by default
(VLLM_CPU_OMP_THREADS_BIND=auto) and refuses to start when there are fewer NUMA
nodes than ranks ("Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers"), as on most single-socket machines and containers. There hsx sets the
variable itself, splitting the cores this process may use evenly across the ranks
("0|1" on 2 cores, "0-7|8-15" on 16); a value the user set is never touched.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import MutableMapping

ENV = "VLLM_CPU_OMP_THREADS_BIND"
log = logging.getLogger("hsx.engine")


def _id_list(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (vLLM parses lists like '5,2-4')."""
    parts, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def split_cores(cpus: list[int], ranks: int) -> str:
    """Equal contiguous shares of `cpus`, one per rank, '|'-separated; leftover cores stay
    with the API and scheduler processes."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        raise ValueError(f"{ranks} CPU workers need at least {ranks} cores; this process may use {len(cpus)}")
    share = len(cpus) // ranks
    return "|".join(_id_list(cpus[r * share : (r + 1) * share]) for r in range(ranks))


def numa_nodes_with(cpus: set[int], node_dir: str = "/sys/devices/system/node") -> int:
    """How many NUMA nodes hold at least one of `cpus` (1 when the kernel does not say)."""
    nodes = 0
    for path in glob.glob(os.path.join(node_dir, "node[0-9]*", "cpulist")):
        with open(path) as fh:
            text = fh.read().strip()
        ids = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            ids.update(range(int(lo), int(hi or lo) + 1))
        nodes += bool(ids & cpus)
    return max(nodes, 1)


def bind_cpu_workers(ranks: int, environ: MutableMapping[str, str] = os.environ,
                     cpus: set[int] | None = None, node_dir: str = "/sys/devices/system/node") -> str | None:
    """Set VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers where vLLM's own binding
    would refuse to start. Returns the value set, or None when nothing was changed."""
    if ranks <= 1 or ENV in environ:
        return None
    cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
    if numa_nodes_with(cpus, node_dir) >= ranks:
        return None  # vLLM's NUMA-aware default works here
    value = split_cores(sorted(cpus), ranks)
    environ[ENV] = value
    log.info("%d CPU workers, fewer NUMA nodes than workers: %s=%r (set it yourself to choose)", ranks, ENV, value)
    return value
