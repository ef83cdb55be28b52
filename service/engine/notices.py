"""The completion channel: the connector in vLLM's worker tells the engine wrapper, over
a ZeroMQ PUSH/PULL socket, that a request's states are in the arena (or that copying failed)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path


class Notices:
    """PULL side of the completion channel: one future per submitted request key."""

    def __init__(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        remove_stale_notify_sockets(tempfile.gettempdir())
        self.address = f"ipc://{tempfile.gettempdir()}/hsx-notify-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
        self._sock.bind(self.address)
        self._waiters: dict[str, asyncio.Future] = {}
        self._streams: dict[str, Callable[[dict], None]] = {}  # chunked saves: every message, until "end"
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="hsx-notices")

    def expect(self, key: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        return fut

    def expect_stream(self, key: str, on_notice: Callable[[dict], None]) -> None:
        """A chunked save (chunks.py): `on_notice` gets each of its messages, the last one
        with "end" (or not "ok")."""
        self._streams[key] = on_notice

    def forget(self, key: str) -> None:
        """No message will come for `key` (given up after a timeout): drop its listener."""
        self._streams.pop(key, None)
        self._waiters.pop(key, None)

    async def _run(self) -> None:
        while True:
            msg = json.loads(await self._sock.recv())
            stream = self._streams.get(msg["key"])
            if stream is not None:
                if msg.get("end") or not msg.get("ok"):
                    del self._streams[msg["key"]]
                stream(msg)
                continue
            fut = self._waiters.pop(msg["key"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def fail_all(self, error: str) -> None:
        """The engine died: no notice will come for anything in flight."""
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result({"key": None, "ok": False, "error": error})
        self._waiters.clear()
        streams, self._streams = self._streams, {}
        for on_notice in streams.values():
            on_notice({"key": None, "ok": False, "error": error, "end": True})

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock.close(linger=0)
        self._ctx.term()
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


def remove_stale_notify_sockets(directory: str) -> list[str]:
    """The notice sockets of hsx servers that died without closing theirs (SIGKILL):
    their names hold the server's pid; this user's whose pid is gone are removed."""
    removed = []
    for path in Path(directory).glob("hsx-notify-*-*.sock"):
        try:
            pid = int(path.name.split("-")[2])
            if path.stat().st_uid != os.getuid() or pid == os.getpid():
                continue
            os.kill(pid, 0)  # alive (or another user's): keep it
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(str(path))
        except (ValueError, OSError):
            continue
    return removed
