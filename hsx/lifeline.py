"""A lifeline: the processes hsx starts die with the process that owns them.

`hsx serve` owns its vLLM engine core and that one's workers, its tokenizer processes and
its HTTP workers; `hsx bench` and `hsx demo` own the `hsx serve` they start. An owner
killed outright (SIGKILL: an OOM killer, a supervisor's hard kill) runs no clean-up, and
its children used to live on with parent 1, holding memory and GPUs.

The owner names itself in HSX_LIFELINE (`pid:start time`, so a reused pid is not taken
for it: `mark_owner` / `child_env`) before it starts children; every process that
inherits the variable and calls `hold()` watches that pid from a daemon thread (a pidfd,
else polling) and SIGKILLs itself when the owner is gone. The variable passes through
every way a child is started (fork, spawn, forkserver, exec), and a grandchild watches
the owner itself, not its parent, so no chain of parents has to hold.

Where `hold()` runs: in every forked child of a process that imported this module
(os.register_at_fork: vLLM's default start method on CPU, the tokenizer pool's
forkserver children); in every process vLLM starts, as a vLLM general plugin (the entry
point `vllm.general_plugins` in pyproject.toml, which vLLM runs in its engine core and
worker processes; spawn is vLLM's method with CUDA); on import of hsx's KV connector
(loaded in every engine process, should VLLM_PLUGINS leave the plugin out); at the start
of the tokenizer processes, the HTTP workers and `hsx serve` itself.

The watcher thread needs the GIL to kill its process, and a process computing in a long
C call holds it: vLLM's worker went on computing for 10-15 s after `kill -9` of hsx serve
on a loaded box. So a forked child also asks the kernel for SIGKILL when its parent ends
(PR_SET_PDEATHSIG, no thread, no GIL): the worker dies the moment its engine core does,
and the engine core, which waits on sockets most of the time, dies by its own watcher. The
kernel's signal fires when the *thread* that forked the child ends, not the process, so
it is asked only for children forked from their parent's main thread (hsx serve starts
vLLM's engine core from a worker thread: that one keeps the watcher alone).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

ENV = "HSX_LIFELINE"
POLL_S = 0.5  # where no pidfd can be opened (kernel < 5.3, not Linux)

_holding_in: int | None = None  # the pid whose watcher thread runs (a forked child has none)


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22); None
    once it has ended (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def token(pid: int) -> str:
    return f"{pid}:{_start_time(pid) or ''}"


def mark_owner() -> None:
    """Children started from now on (and theirs) die with this process."""
    os.environ[ENV] = token(os.getpid())


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child that must die with this process."""
    return {**env, ENV: token(os.getpid())}


def _owner_gone(pid: int, start: str) -> bool:
    if os.path.exists("/proc/self/stat"):
        now = _start_time(pid)
        return now is None or (bool(start) and now != start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _watch(pid: int, start: str) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or the owner is gone already
        fd = None
    if fd is not None and not _owner_gone(pid, start):  # the fd names the very process checked
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll()  # readable once the owner has exited
    else:
        while not _owner_gone(pid, start):
            time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def hold() -> None:
    """Die with the owner named in HSX_LIFELINE. Does nothing without one, in the owner
    itself, or where this process already holds it; safe to call any number of times."""
    global _holding_in
    value = os.environ.get(ENV, "")
    pid_text, _, start = value.partition(":")
    if not pid_text.isdigit() or int(pid_text) == os.getpid() or _holding_in == os.getpid():
        return
    _holding_in = os.getpid()
    threading.Thread(target=_watch, args=(int(pid_text), start), name="hsx-lifeline", daemon=True).start()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Set in the parent just before each fork; the child reads its own copy.
_fork_parent = 0
_forked_from_main = False


def _before_fork() -> None:
    global _fork_parent, _forked_from_main
    _fork_parent = os.getpid()
    _forked_from_main = threading.current_thread() is threading.main_thread()


def _die_with_parent() -> None:
    """SIGKILL from the kernel when the parent (its forking thread: its main one) ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no libc prctl here: the watcher alone
        return
    if os.getppid() != _fork_parent:  # the parent ended before the request took hold
        os.kill(os.getpid(), signal.SIGKILL)


def _after_fork_in_child() -> None:
    if _forked_from_main and os.environ.get(ENV) and sys.platform.startswith("linux"):
        _die_with_parent()
    hold()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
