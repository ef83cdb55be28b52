"""A real `hsx serve` in a child process: start it, wait for /ready, read /metrics, stop it.

One helper for everything that runs a server of its own: `hsx bench`, `hsx demo` and the
tests. The child leads its own session, so `stop()` takes vLLM's engine processes down
with it (they live in the server's process group).

The tool that starts a server owns its death (`own`): SIGTERM / SIGHUP to the tool raise
SystemExit, so its `finally: server.stop()` runs (SIGINT does so as KeyboardInterrupt),
an exit without one stops what is left (atexit), and a tool killed outright (SIGKILL)
takes the server with it through the lifeline (hsx/lifeline.py).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hsx import lifeline

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
EXIT_STOP_GRACE = 30.0  # seconds the servers still running at exit get to drain

_owned: list[subprocess.Popen] = []
_signals_owned = False


class ServerStartError(RuntimeError):
    """`hsx serve` exited or did not become ready; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own(proc: subprocess.Popen) -> None:
    """`proc` (leading its own session) is stopped when this process is: see the module
    docstring."""
    global _signals_owned
    _owned.append(proc)
    if _signals_owned or threading.current_thread() is not threading.main_thread():
        return
    _signals_owned = True
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:  # a handler of the tool's own stays
            signal.signal(sig, _exit_on_signal)
    atexit.register(_stop_owned)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the tool's `finally: server.stop()`


def _stop_owned() -> None:
    """At exit: SIGTERM every owned process still running at once, so they drain side by
    side, then `stop_process_group` each."""
    live = [p for p in _owned if p.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + EXIT_STOP_GRACE
    for proc in live:
        stop_process_group(proc, max(0.0, deadline - time.monotonic()))


def stop_process_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM `proc`, give it `grace` seconds, then SIGKILL its whole process group (it
    must lead its own session: `start_new_session=True`)."""
    if proc in _owned:
        _owned.remove(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class MetricValues:
    """A /metrics page parsed with prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self._samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self._samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, default: float | None = None, **labels: str) -> float:
        """The sample `name` (as exposed: counters end in `_total`) with exactly `labels`."""
        value = self._samples.get((name, tuple(sorted(labels.items()))), default)
        if value is None:
            raise KeyError(f"no metric {name}{labels or ''}")
        return value

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """{value of `label`: sample value} over the samples of `name`."""
        return {dict(lbl)[label]: v for (n, lbl), v in self._samples.items() if n == name and label in dict(lbl)}


def read_metrics(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> MetricValues:
    import httpx

    r = httpx.get(url.rstrip("/") + "/metrics", headers=headers or {}, timeout=timeout)
    r.raise_for_status()
    return MetricValues(r.text)


class ServerProcess:
    """`hsx serve MODEL --host HOST --port PORT ARGS...` with its output in `log_path`."""

    def __init__(self, model: str, *args: str, log_path: Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.cmd = [sys.executable, "-m", "hsx_tools.cli", "serve", model, "--host", host, "--port", str(self.port), *args]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=lifeline.child_env(env if env is not None else dict(os.environ)),
                                     start_new_session=True)
        own(self.proc)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        """Poll /ready every 0.5 s; on an early exit or a timeout, stop the server and raise."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise ServerStartError(f"hsx serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"hsx serve not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def metrics(self, headers: dict[str, str] | None = None) -> MetricValues:
        return read_metrics(self.url, headers)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains), SIGKILL after `timeout`; then the whole process
        group, so no engine process is left behind. Returns the exit status."""
        stop_process_group(self.proc, timeout)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
