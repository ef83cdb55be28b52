"""Thread binding of vLLM's CPU workers when one engine runs several ranks (TP > 1).

vLLM's CPU backend binds each rank's OpenMP threads to one NUMA node by default
(VLLM_CPU_OMP_THREADS_BIND=auto) and refuses to start when there are fewer NUMA
nodes than ranks ("Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers"), as on most single-socket machines and containers. There hsx sets the
variable itself, splitting the cores this process may use evenly across the ranks
("0|1" on 2 cores, "0-7|8-15" on 16); a value the user set is never touched.

It also keeps vLLM's core reservation what it is without a KV connector. vLLM reserves cores
for the EngineCore process (which busy-polls its workers) and, whenever a kv_transfer_config is
set, one more per rank for NIXL's prefill/decode transfers. hsx's connector does no such
transfer, yet counts as one: on 2 cores the reservation (2) then reaches the core count, vLLM
drops it and runs the worker's OpenMP threads on every core, beside the polling scheduler and the
API process, and each decode step slowed to several times `vllm serve`'s. So hsx sets
VLLM_CPU_NUM_OF_RESERVED_CPU to vLLM's connector-less count (unless the user set it).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import MutableMapping

ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
log = logging.getLogger("hsx.engine")


def _id_list(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (vLLM parses lists like '5,2-4')."""
    parts, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def cpu_ids(cpu_list: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]: a Linux CPU list (sysfs cpulist, VLLM_CPU_OMP_THREADS_BIND's per rank)."""
    ids = []
    for part in filter(None, cpu_list.strip().split(",")):
        lo, _, hi = part.partition("-")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


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
            nodes += bool(set(cpu_ids(fh.read())) & cpus)
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


def reserved_without_connector(local_ranks: int, arch: str) -> int:
    """vLLM's own reservation (vllm/utils/ompmultiprocessing.py) when no kv_transfer_config is set:
    one core per local rank on x86, ARM and RISC-V, else one."""
    return local_ranks if arch in ("X86", "ARM", "RISCV") else 1


def reserve_cores_as_without_connector(local_ranks: int, environ: MutableMapping[str, str] = os.environ,
                                       arch: str | None = None) -> str | None:
    """Set VLLM_CPU_NUM_OF_RESERVED_CPU so hsx's connector costs no extra core. Returns the value
    set, or None when the user set it."""
    if RESERVED_ENV in environ:
        return None
    if arch is None:
        from vllm.platforms import current_platform

        arch = current_platform.get_cpu_architecture().name
    value = str(reserved_without_connector(local_ranks, arch))
    environ[RESERVED_ENV] = value
    log.info("CPU backend: %s=%s (vLLM reserves one more core per rank for any KV connector, meant for NIXL; "
             "hsx's needs none). vLLM's warning that it is below the minimum refers to that extra core",
             RESERVED_ENV, value)
    return value
