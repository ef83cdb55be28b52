"""Memory of the benchmark's processes: RSS / PSS of a process tree sampled with psutil,
and the kernel's own peak (VmHWM) of a process."""

from __future__ import annotations

import threading
from typing import Any

import psutil


def kernel_peak_rss(pid: int) -> int | None:
    """VmHWM in bytes: the kernel's exact peak RSS of one process (psutil does not expose
    it; sampling can miss a short peak)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_own_hwm() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def own_memory() -> dict[str, Any]:
    return {"peak_rss": kernel_peak_rss(psutil.Process().pid), "rss_now": psutil.Process().memory_info().rss}


class TreeSampler:
    """Samples the RSS/PSS of a process tree every `interval` s in a thread.

    peak_rss: the largest sum of RSS over the tree seen at one sample (shared pages,
    e.g. a shared-memory arena mapped by two processes, count twice); peak_pss: the same
    with proportional set size (shared pages split); hwm: VmHWM of each process seen
    (the kernel's own peak, exact per process); root_peak_rss: the root process alone.
    `exclude`: roots of subtrees left out (the client's figure without the server it started)."""

    def __init__(self, root: int, interval: float = 0.5, exclude: tuple[int, ...] = ()):
        self.root = root
        self.interval = interval
        self.exclude = exclude
        self.peak_rss = 0
        self.peak_pss = 0
        self.root_peak_rss = 0
        self.hwm: dict[int, int] = {}
        self.last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hsx-bench-rss", daemon=True)

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.root)
            tree = [root, *root.children(recursive=True)]
            skip = set(self.exclude)
            for pid in self.exclude:
                try:
                    skip.update(c.pid for c in psutil.Process(pid).children(recursive=True))
                except psutil.Error:
                    pass
            return [p for p in tree if p.pid not in skip]
        except psutil.Error:
            return []

    def sample(self) -> dict[str, int]:
        rss = pss = root_rss = 0
        for p in self._tree():
            try:
                mem = p.memory_full_info()  # pss reads smaps_rollup; falls back to rss below
            except psutil.AccessDenied:
                try:
                    mem = p.memory_info()
                except psutil.Error:
                    continue
            except psutil.Error:
                continue
            rss += mem.rss
            pss += getattr(mem, "pss", mem.rss)
            peak = kernel_peak_rss(p.pid)
            if peak is not None:
                self.hwm[p.pid] = max(self.hwm.get(p.pid, 0), peak)
            if p.pid == self.root:
                root_rss = mem.rss
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.root_peak_rss = max(self.root_peak_rss, root_rss)
        self.last = {"rss": rss, "pss": pss, "root_rss": root_rss}
        return self.last

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "TreeSampler":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        return {
            "peak_rss_sum": self.peak_rss,
            "peak_pss_sum": self.peak_pss,
            "root_peak_rss": self.root_peak_rss,
            "sum_of_process_hwm": sum(self.hwm.values()),
            "processes": len(self.hwm),
        }
