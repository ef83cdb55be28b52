"""Facts about the host this process runs on, shared by the server and the client."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's
    limit, not the machine's count), which every thread and process default sizes from."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
