"""Crash safety of `hsx regenerate`: plan, journal, atomic output (hsx_client.corpus.store's writes).

Beside the output file PATH, the directory PATH.hsx-regen/ holds:
  .lock          one writer (DirLock; the kernel drops it with the process)
  plan.json      the conversation keys and the settings the run was started with; once a
                 conversation is journaled, a rerun with other settings is refused (what was
                 generated would not match); before that, the rerun's settings replace them
  journal.jsonl  one line per finished conversation, appended and fsync'ed before the
                 next is counted done. A kill can only leave a torn last line, which a
                 rerun cuts off (that conversation is generated again).
PATH itself is written once every planned conversation is in the journal (or at the end
of a run, with those that are), atomically (temporary name, fsync, rename), in plan order,
so a rerun after a kill gives the same file as an uninterrupted run wherever the engine
is deterministic (greedy, or seeded: each conversation's seed comes from --seed and its
key). PATH.manifest.json records its checksum, counts and provenance.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hsx_client.corpus import store
from hsx_client.corpus.journal import DirLock

PLAN_VERSION = 1


class PlanMismatch(store.StoreError):
    pass


def work_dir(output: Path) -> Path:
    return output.with_name(output.name + ".hsx-regen")


def manifest_path(output: Path) -> Path:
    return output.with_name(output.name + ".manifest.json")


class Journal:
    def __init__(self, output: Path) -> None:
        self.output = Path(output)
        self.dir = work_dir(self.output)
        self.lock = DirLock(self.dir)
        self.done: dict[str, dict[str, Any]] = {}
        self._fh = None

    def open(self, plan: dict[str, Any]) -> None:
        """Lock, check or write the plan, read what earlier runs finished."""
        self.lock.acquire("hsx regenerate")
        plan = {"version": PLAN_VERSION, **plan}
        path = self.dir / "journal.jsonl"
        self._cut_torn_tail(path)
        if path.exists():
            for line in path.read_bytes().splitlines():
                entry = json.loads(line)
                self.done[entry["key"]] = entry["row"]
        plan_file = self.dir / "plan.json"
        old = json.loads(plan_file.read_text()) if plan_file.exists() else None
        diff = sorted(k for k in set(old or {}) | set(plan) if (old or {}).get(k) != plan.get(k))
        if old is not None and diff and self.done:
            raise PlanMismatch(f"{self.output} was started with other settings ({', '.join(diff)} differ); "
                               f"use another --output, or remove {self.dir} and {self.output} to start over")
        if old is None or diff:  # a run that journaled nothing binds no settings: the new ones replace it
            store.write_json_atomic(plan_file, plan)
        self._fh = open(path, "ab")

    @staticmethod
    def _cut_torn_tail(path: Path) -> None:
        if not path.exists():
            return
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            with open(path, "r+b") as fh:
                fh.truncate(keep)
                os.fsync(fh.fileno())

    def record(self, key: str, row: dict[str, Any] | None) -> None:
        line = json.dumps({"key": key, "row": row}, ensure_ascii=False, separators=(",", ":")) + "\n"
        assert self._fh is not None
        self._fh.write(line.encode())
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.done[key] = row

    def write_output(self, keys: list[str], manifest: dict[str, Any]) -> dict[str, Any]:
        """PATH from the journal in plan order, then its manifest; returns the manifest."""
        # A None row is a dropped conversation (no room for its first reply): not written.
        rows = [json.dumps(self.done[k], ensure_ascii=False) + "\n" for k in keys if self.done.get(k) is not None]
        data = "".join(rows).encode()
        store.write_file_atomic(self.output, data)
        manifest = {**manifest, "rows": len(rows), "size": len(data),
                    store.HASH_ALGO: store.file_digest(data)}
        store.write_json_atomic(manifest_path(self.output), manifest)
        return manifest

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.lock.release()
