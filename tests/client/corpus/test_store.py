"""Crash-safe store: atomic writes, manifest torn-line recovery, lock, disk check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple

import hashlib

import pytest
import xxhash

from hsx_client.corpus import journal, store


def _tmp_files(root):
    return [p for p in root.rglob("*") if store.TMP_MARK in p.name]


def test_write_files_atomic(tmp_path):
    info = store.write_files_atomic(tmp_path, {"a/b/x.bin": b"hello", "y.bin": bytearray(b"\x00" * 10)})
    assert (tmp_path / "a/b/x.bin").read_bytes() == b"hello"
    assert info["a/b/x.bin"]["size"] == 5
    assert info["a/b/x.bin"]["xxh3_128"] == store.file_digest(b"hello") == xxhash.xxh3_128(b"hello").hexdigest()
    assert store.hash_file(tmp_path / "y.bin") == (10, info["y.bin"]["xxh3_128"])
    assert not _tmp_files(tmp_path)
    # overwrite in place (a redo) is atomic too
    store.write_files_atomic(tmp_path, {"y.bin": b"new"})
    assert (tmp_path / "y.bin").read_bytes() == b"new"


def test_write_failure_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "old.bin").write_bytes(b"old")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.os, "replace", boom)
    with pytest.raises(OSError):
        store.write_files_atomic(tmp_path, {"old.bin": b"newer"})
    assert (tmp_path / "old.bin").read_bytes() == b"old"
    assert not _tmp_files(tmp_path)


def test_entries_recorded_with_sha256_are_still_checked(tmp_path):
    """Corpora written before the switch to XXH3-128 record SHA-256: verify and merge's
    copy check those files with SHA-256, and still catch a corrupted one."""
    (tmp_path / "a.bin").write_bytes(b"states")
    old = {"files": {"a.bin": {"size": 6, "sha256": hashlib.sha256(b"states").hexdigest()}}}
    assert store.recorded_digest(old["files"]["a.bin"]) == ("sha256", hashlib.sha256(b"states").hexdigest())
    assert store.check_checksums(tmp_path, old) == []
    assert store.copy_file_atomic(tmp_path / "a.bin", tmp_path / "b.bin",
                                  expected=store.recorded_digest(old["files"]["a.bin"])) == hashlib.sha256(b"states").hexdigest()
    (tmp_path / "a.bin").write_bytes(b"stateZ")
    assert store.check_checksums(tmp_path, old) == ["a.bin: sha256 mismatch (file corrupted)"]
    with pytest.raises(store.ChecksumError, match="sha256 differs"):
        store.copy_file_atomic(tmp_path / "a.bin", tmp_path / "c.bin", expected=store.recorded_digest(old["files"]["a.bin"]))
    assert not (tmp_path / "c.bin").exists()
    new = {"files": {"a.bin": {"size": 6, "xxh3_128": xxhash.xxh3_128(b"states").hexdigest()}}}
    assert store.check_checksums(tmp_path, new) == ["a.bin: xxh3_128 mismatch (file corrupted)"]


def test_refuses_paths_outside(tmp_path):
    for bad in ("../x", "/etc/x", "manifest.jsonl", "plan.json"):
        with pytest.raises(ValueError):
            store.write_files_atomic(tmp_path, {bad: b"x"})


def test_clean_temp_files(tmp_path):
    (tmp_path / "d").mkdir()
    left = tmp_path / "d" / f".hs_1.safetensors{store.TMP_MARK}123-abcd"
    left.write_bytes(b"partial")
    keep = tmp_path / "d" / "hs_1.safetensors"
    keep.write_bytes(b"whole")
    assert store.clean_temp_files(tmp_path) == 1
    assert not left.exists() and keep.exists()


def test_clean_temp_files_of_one_process_keeps_the_others(tmp_path):
    dead = tmp_path / f".a.bin{store.TMP_MARK}123-abcd"
    alive = tmp_path / f".b.bin{store.TMP_MARK}1234-abcd"  # a pid that merely starts alike
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert store.clean_temp_files(tmp_path, pid=123) == 1
    assert not dead.exists() and alive.exists()


def test_a_formats_own_temp_names_are_cleaned_after_a_crash(tmp_path, monkeypatch):
    """finalize's scratch table dir and its atomic single files use the store's names, so
    what a crash leaves of them goes with the next run's clean-up, like sample files."""
    scratch = store.temp_dir(tmp_path, "hsx_finalize")
    (scratch / "table").mkdir()
    (scratch / "table" / "data-00000-of-00001.arrow").write_bytes(b"half a table")

    def crash(src, dst):
        raise KeyboardInterrupt  # a kill between the write and the rename

    monkeypatch.setattr(store.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.write_file_atomic(tmp_path / "vocab_mapping" / "vocab_mapping.pt", b"x" * 10)
    monkeypatch.undo()
    # write_files_atomic removes its temp file on the way out; a kill -9 would not
    stray = tmp_path / "vocab_mapping" / f".vocab_mapping.pt{store.TMP_MARK}999-beef"
    stray.write_bytes(b"x")
    assert store.clean_temp_files(tmp_path) == 2
    assert not scratch.exists() and not stray.exists() and not _tmp_files(tmp_path)


def test_manifest_torn_line_recovery(tmp_path):
    p = tmp_path / "manifest.jsonl"
    log = journal.JsonlLog(p)
    for i in range(3):
        log.append({"index": i, "key": f"k{i}"})
    log.close()
    with open(p, "ab") as f:  # a crash in the middle of an append
        f.write(b'{"index": 3, "key": "k3", "fil')
    entries, good, bad = journal.read_jsonl(p)
    assert [e["index"] for e in entries] == [0, 1, 2] and bad == 1
    log = journal.JsonlLog(p)  # reopening cuts the torn tail
    assert [e["index"] for e in log.entries] == [0, 1, 2]
    assert p.stat().st_size == good
    log.append({"index": 3, "key": "k3"})
    log.close()
    lines = p.read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1, 2, 3]


def test_manifest_garbage_last_line_with_newline(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_bytes(b'{"index": 0}\n{"index": 1, "ke\n')
    entries, good, bad = journal.read_jsonl(p)
    assert [e["index"] for e in entries] == [0] and good == len(b'{"index": 0}\n') and bad == 1


def test_manifest_concurrent_appends(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    p = tmp_path / "m.jsonl"
    log = journal.JsonlLog(p)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: log.append({"index": i, "pad": "x" * 1000}), range(200)))
    log.close()
    entries, _, bad = journal.read_jsonl(p)
    assert bad == 0 and sorted(e["index"] for e in entries) == list(range(200))


def test_latest_by_index_and_invalidation():
    entries = [
        {"index": 0, "v": 1},
        {"index": 1, "v": 1},
        {"index": 0, "v": 2},
        {"index": 1, "invalid": True},
    ]
    latest = journal.latest_by_index(entries)
    assert latest == {0: {"index": 0, "v": 2}}


def test_size_and_checksum_checks(tmp_path):
    files = store.write_files_atomic(tmp_path, {"s.bin": b"0123456789"})
    entry = {"files": files}
    assert store.check_sizes(tmp_path, entry) == [] and store.check_checksums(tmp_path, entry) == []
    (tmp_path / "s.bin").write_bytes(b"0123456780")  # same size, one byte flipped
    assert store.check_sizes(tmp_path, entry) == []
    assert "corrupted" in store.check_checksums(tmp_path, entry)[0]
    (tmp_path / "s.bin").write_bytes(b"01234")  # truncated
    assert "size 5" in store.check_sizes(tmp_path, entry)[0]
    (tmp_path / "s.bin").unlink()
    assert "missing" in store.check_sizes(tmp_path, entry)[0]


def test_lock_exclusion(tmp_path):
    lock = journal.DirLock(tmp_path).acquire("hsx extract")
    try:
        with pytest.raises(store.LockedError) as ei:
            journal.DirLock(tmp_path).acquire()
        assert f"pid={os.getpid()}" in str(ei.value)
        code = (
            "import sys; from hsx_client.corpus import journal, store\n"
            "try:\n journal.DirLock(sys.argv[1]).acquire()\nexcept store.LockedError as e:\n print(e); sys.exit(3)\n"
        )
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
        assert r.returncode == 3 and "in use" in r.stdout
    finally:
        lock.release()
    journal.DirLock(tmp_path).acquire().release()  # free again


def test_lock_released_when_process_dies(tmp_path):
    code = "import os, sys; from hsx_client.corpus import journal; journal.DirLock(sys.argv[1]).acquire(); os._exit(9)"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)])
    assert r.returncode == 9
    journal.DirLock(tmp_path).acquire().release()


def test_disk_space_refusal(tmp_path, monkeypatch):
    from hsx_client.corpus import disk_estimate as disk

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: Usage(10**12, 0, 10**9))
    with pytest.raises(disk.InsufficientDiskError) as ei:
        disk.check_disk_space(tmp_path / "new" / "dir", 2 * 10**9)
    assert "--force-disk" in str(ei.value) and "2.3 GB" in str(ei.value)
    est = disk.check_disk_space(tmp_path, 2 * 10**9, force=True)
    assert not est.ok
    assert disk.check_disk_space(tmp_path, 10**8).ok
