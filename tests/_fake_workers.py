"""Worker-process stand-ins for tests/client/corpus/test_workers.py (module level: 'spawn' imports them).

They speak hsx_client.corpus.workers' pipe protocol and store real files, but fetch nothing; how
they misbehave is in spec.corpus['settings']: `die_after` (SIGKILL themselves after that many stored
samples; `die_once`: only the first worker to claim the marker file), `error` (report a
fatal error), `unsent` (die after writing the files, before sending the line), `slow` (seconds per sample)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from hsx_client.corpus import store
from hsx_client.corpus.worker_messages import End, Exited, Progressed, Ready, Stop, Stored


@dataclass
class Sample:
    key: str
    request: dict


def _claim(out, name: str) -> bool:
    try:
        os.close(os.open(out / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def fake_worker(conn, spec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    s, out = spec.corpus["settings"], spec.corpus["out"]
    dies = s.get("die_after") is not None and (not s.get("die_once") or _claim(out, "died"))
    stored = 0
    time.sleep(s.get("start_delay", 0))  # a slow start (imports) before it says ready
    conn.send(Ready())
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if isinstance(msg, (End, Stop)):
            conn.send(Exited(None, {"stats": {"u": {"ok": stored, "healthy": True}}, "store_s": 0.5, "life_s": 0.75}))
            return
        if s.get("error"):
            conn.send(Exited(s["error"]))
            return
        for index, sample in msg.items:
            time.sleep(s.get("slow", 0))
            files = store.write_files_atomic(out, {f"s/{index}.bin": sample.key.encode() * 100})
            if dies and s.get("unsent") and stored + 1 >= s["die_after"]:  # files written, no line
                if s.get("half_written"):  # and one more cut off mid-write, as a kill leaves it
                    store._tmp_name(out / "s" / f"{index}.next").write_bytes(b"half")
                os.kill(os.getpid(), signal.SIGKILL)
            conn.send(Stored({"key": sample.key, "index": index, "files": files, "record": {}, "tokens": 3,
                                  "request_id": f"r{index}"}))
            conn.send(Progressed(3, 10, 300))
            stored += 1
            if dies and stored >= s["die_after"]:
                os.kill(os.getpid(), signal.SIGKILL)
