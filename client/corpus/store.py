"""Crash-safe storage of a corpus directory.

Layout of an output dir (besides the files the corpus format writes):

    .lock               flock'ed by the one writer (`hsx extract` / `hsx verify`)
    plan.json           settings + the key of every planned sample, by final index
    manifest.jsonl      one line per stored sample: {key, index, files, record}
    failed.jsonl        one line per sample that failed for good or was dropped by policy
                        (kind "dropped"): {key, index, kind, message, ...}
    bad_rows.jsonl      the input rows that could not be used: {source (file:line), kind, reason}
    verify.json         written by `hsx verify`: the indices found bad (resume redoes them)
    hsx_corpus.json     provenance + counts; written last, so it marks a finished corpus
    hsx_compaction.json written by a format's finalize when it renumbers samples

Rules that make a kill -9 at any point safe:
- every file is written to a temporary name in its final directory (`.NAME.hsx-tmp-PID-RAND`),
  flushed, fsync'ed, `os.replace`d into place, and the directory fsync'ed; the corpus
  formats write their own files (finalize's table, vocab files) the same way, through
  `write_file_atomic` and `temp_dir`;
- only then is the manifest line appended and fsync'ed; a sample counts only once its
  line is complete (a torn last line is cut off when the manifest is reopened);
- temporary files and directories (TMP_MARK in the name) left by a crash are removed when
  the next writer starts.
Checksums are XXH3-128 (the `xxhash` package), computed from the bytes in memory while
writing. They guard against torn writes and bit rot, not against an adversary; every byte
of states is hashed once, so the hash is the fast one (bench/checksum.py compares it with
SHA-256). Corpora recorded with SHA-256 stay valid: a file is checked with the algorithm
its entry names. The lock and the JSONL logs are hsx_client.corpus.journal's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

import xxhash


TMP_MARK = ".hsx-tmp-"
LOCK_NAME = ".lock"
PLAN_NAME = "plan.json"
MANIFEST_NAME = "manifest.jsonl"
FAILED_NAME = "failed.jsonl"
BAD_ROWS_NAME = "bad_rows.jsonl"
VERIFY_NAME = "verify.json"
CORPUS_NAME = "hsx_corpus.json"
# Written by a format's finalize when it renumbers samples (speculators compacts failed
# indices away); maps manifest index -> final index. See hsx_client.corpus.formats
COMPACTION_JOURNAL = "hsx_compaction.json"
HASH_ALGO = "xxh3_128"  # what new entries record
_HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # what entries may name

# Names the store owns; a format must not write these.
RESERVED = {LOCK_NAME, PLAN_NAME, MANIFEST_NAME, FAILED_NAME, BAD_ROWS_NAME, VERIFY_NAME, CORPUS_NAME}


class StoreError(Exception):
    """A problem with the output directory a person has to resolve."""


class LockedError(StoreError):
    pass


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on a directory
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


Buffer = bytes | bytearray | memoryview
# A file's content: one buffer, or a list of buffers written one after the other (a
# corpus file laid out from a small header and the states' own memory, no join copy).
FileData = Buffer | list[Buffer] | tuple[Buffer, ...]


def _parts(data: FileData) -> list[memoryview]:
    parts = data if isinstance(data, (list, tuple)) else [data]
    return [memoryview(p).cast("B") for p in parts]


def file_size(data: FileData) -> int:
    return sum(v.nbytes for v in _parts(data))


def _write_fsync(path: Path, data: FileData) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for view in _parts(data):
            while view:
                n = os.write(fd, view[: 1 << 30])
                view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def new_hash(algo: str = HASH_ALGO) -> Any:
    return _HASHES[algo]()


def recorded_digest(meta: dict[str, Any]) -> tuple[str, str] | None:
    """(algorithm, hex digest) a file's entry records, or None when it names none known."""
    for algo in _HASHES:
        if algo in meta:
            return algo, meta[algo]
    return None


def file_digest(data: FileData, algo: str = HASH_ALGO) -> str:
    h = new_hash(algo)
    for view in _parts(data):
        h.update(view)
    return h.hexdigest()


def write_files_atomic(
    root: Path, files: dict[str, FileData], *, _reserved_ok: bool = False
) -> dict[str, dict[str, Any]]:
    """Store `files` (relpath -> bytes) under `root`, each atomically; return their
    {relpath: {"size", HASH_ALGO}}. The directories are fsync'ed once each at the end."""
    root = Path(root)
    info: dict[str, dict[str, Any]] = {}
    dirs: set[Path] = set()
    for rel, data in files.items():
        final = safe_join(root, rel, reserved_ok=_reserved_ok)
        final.parent.mkdir(parents=True, exist_ok=True)
        _replace_via_tmp(final, lambda tmp, data=data: _write_fsync(tmp, data))
        dirs.add(final.parent)
        info[rel] = {"size": file_size(data), HASH_ALGO: file_digest(data)}
    for d in dirs:
        fsync_dir(d)
    return info


def _replace_via_tmp(final: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary name beside `final`, then rename it over `final`; the
    temporary file is removed if anything fails."""
    tmp = _tmp_name(final)
    try:
        write(tmp)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


class StreamedFile:
    """One file written in order, piece by piece, as a sample's states arrive (issue 29):
    under a temporary name (so a crash leaves no partial file under the final one, and the
    next run's `clean_temp_files` removes it), hashed on the way in file order (the same
    digest `write_files_atomic` records of a whole file), then fsync'ed and renamed by
    `commit`. `abort` removes it. Calls come from one thread at a time."""

    def __init__(self, root: Path, rel: str) -> None:
        self.rel = rel
        self.final = safe_join(Path(root), rel)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _tmp_name(self.final)
        self._fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._hash = new_hash()
        self.size = 0

    def write(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += view.nbytes
        assert self._fd is not None
        while view:
            n = os.write(self._fd, view[: 1 << 30])
            view = view[n:]

    def commit(self) -> dict[str, Any]:
        """fsync, rename over the final name, fsync the directory; the file's entry."""
        assert self._fd is not None
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return {"size": self.size, HASH_ALGO: self._hash.hexdigest()}

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self.tmp.unlink()
        except OSError:
            pass


class ChecksumError(StoreError):
    pass


def copy_file_atomic(src: Path, dst: Path, *, expected: tuple[str, str] | None = None,
                     head: tuple[int, bytes] | None = None, chunk: int = 8 << 20) -> str:
    """Copy `src` to `dst` atomically (temporary name, fsync, rename), hashing the bytes on
    the way; returns the digest of what was written. With `expected` (algorithm, digest:
    `recorded_digest`), a source of another digest raises ChecksumError and `dst` is left as
    it was. `head` (n, data): the source's first n bytes are written as `data` instead (the
    returned digest is then HASH_ALGO's of the new file). The caller fsyncs `dst`'s directory."""
    algo = expected[0] if expected is not None else HASH_ALGO
    h = new_hash(algo)  # the source's bytes
    out = h if head is None else new_hash()  # the written bytes: the same unless the head changes

    def write_all(fo: Any, data: Any) -> None:
        while data:
            data = data[fo.write(data):]

    def write(tmp: Path) -> None:
        buf = bytearray(chunk)
        view = memoryview(buf)
        with open(src, "rb", buffering=0) as fi, open(tmp, "xb", buffering=0) as fo:
            if head is not None:
                old_len, data = head
                while old_len > 0 and (part := fi.read(old_len)):  # a raw read may return less
                    h.update(part)
                    old_len -= len(part)
                out.update(data)
                write_all(fo, memoryview(data))
            while n := fi.readinto(buf):
                h.update(view[:n])
                if out is not h:
                    out.update(view[:n])
                write_all(fo, view[:n])
            os.fsync(fo.fileno())
        if expected is not None and h.hexdigest() != expected[1]:
            raise ChecksumError(f"{src}: {algo} differs from the recorded one (the file is corrupted)")

    _replace_via_tmp(Path(dst), write)
    return out.hexdigest()


def write_file_atomic(path: Path, data: FileData) -> None:
    """One file, any name (a format's own files, the store's JSON files)."""
    path = Path(path)
    write_files_atomic(path.parent, {path.name: data}, _reserved_ok=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_file_atomic(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def temp_dir(root: Path, what: str) -> Path:
    """A new scratch directory under `root`, named so that `clean_temp_files` removes it
    when a crash leaves it behind."""
    path = Path(root) / f".{what}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _not_relative_inside(p: Path) -> bool:
    """Absolute, empty, or climbing out with `..`: not a path below a root."""
    return p.is_absolute() or ".." in p.parts or not p.parts


def safe_join(root: Path, rel: str, *, reserved_ok: bool = False) -> Path:
    p = Path(rel)
    if _not_relative_inside(p):
        raise ValueError(f"refusing to write outside the output dir: {rel!r}")
    if not reserved_ok and len(p.parts) == 1 and p.name in RESERVED:
        raise ValueError(f"{rel!r} is a name the store reserves")
    return root / p


class UnsafePathError(StoreError):
    """A recorded path that would lead outside the corpus directory."""


def inside(root: Path, rel: str) -> Path:
    """`root / rel` for a path a corpus records (a manifest's file, a finalize output),
    refused (UnsafePathError) when it is absolute, climbs out with `..`, or resolves
    outside `root` through a symlink: a tampered record must not make a reader (verify,
    merge, resume) open or link a file elsewhere."""
    p = Path(rel)
    if _not_relative_inside(p):
        raise UnsafePathError(f"{rel!r} is not a path inside the corpus")
    full = Path(root) / p
    real_root, real = os.path.realpath(root), os.path.realpath(full)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise UnsafePathError(f"{rel!r} leads outside the corpus (to {real}, through a symlink)")
    return full


def unsafe_paths(root: Path, entry: dict[str, Any]) -> list[str]:
    """Why the files a manifest line names are not all inside `root` (empty: they are)."""
    problems = []
    for rel in entry.get("files", {}):
        try:
            inside(root, rel)
        except UnsafePathError as exc:
            problems.append(str(exc))
    return problems


def hash_file(path: Path, chunk: int = 8 << 20, algo: str = HASH_ALGO) -> tuple[int, str]:
    """(size, hex digest) of a file on disk."""
    h = new_hash(algo)
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _is_temp(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def clean_temp_files(root: Path, pid: int | None = None) -> int:
    """Remove the temporary files and directories a crashed writer left under `root`
    (only those process `pid` named, when given: a dead extract worker's, while the
    others write on). Returns how many."""
    mark = TMP_MARK if pid is None else f"{TMP_MARK}{pid}-"
    removed = 0
    stack = [Path(root)]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except FileNotFoundError:
            continue
        for e in entries:
            is_dir = e.is_dir(follow_symlinks=False)
            if _is_temp(e.name) and mark in e.name:
                if is_dir:
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    try:
                        os.unlink(e.path)
                    except FileNotFoundError:
                        continue
                removed += 1
            elif is_dir:
                stack.append(Path(e.path))
    return removed


def check_output_dir(out: Path) -> None:
    """Refuse, in one line, an output path that cannot become a corpus directory: a file,
    a path under a file, or one whose nearest existing folder cannot be written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StoreError(f"--output {out} is a file, not a directory; pick a directory")
    p = out
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise StoreError(f"--output {out}: {p} is a file, so nothing can be created under it")
    if not os.access(p, os.W_OK | os.X_OK):
        raise StoreError(f"--output {out}: {p} is not writable (read-only file system or permissions)")


def first_missing(out: Path) -> Path | None:
    """The top-most folder of `out`'s path that does not exist yet (what mkdir -p makes)."""
    out = Path(out).absolute()
    top = None
    p = out
    while not p.exists():
        top, p = p, p.parent
    return top


def remove_new_dir(out: Path, created: Path | None, lock_existed: bool) -> None:
    """Undo what a refused run made before its plan: the lock file it created, and the
    folders it created (`created`: the top-most, from `first_missing`), if empty."""
    out = Path(out).absolute()
    if not lock_existed:
        try:
            (out / LOCK_NAME).unlink()
        except OSError:
            pass
    if created is None:
        return
    p = out
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == created or p.parent == p:
            return
        p = p.parent


def check_sizes(root: Path, entry: dict[str, Any]) -> list[str]:
    """Cheap check at resume: every recorded file exists with its recorded size."""
    problems = unsafe_paths(root, entry)
    if problems:
        return problems
    for rel, meta in entry.get("files", {}).items():
        try:
            size = os.stat(Path(root) / rel).st_size
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if size != meta.get("size"):
            problems.append(f"{rel}: size {size}, recorded {meta.get('size')}")
    return problems


def check_checksums(root: Path, entry: dict[str, Any]) -> list[str]:
    """Full check (verify): size and checksum of every recorded file."""
    problems = unsafe_paths(root, entry)
    if problems:
        return problems
    for rel, meta in entry.get("files", {}).items():
        algo, want = recorded_digest(meta) or (HASH_ALGO, None)
        try:
            size, digest = hash_file(Path(root) / rel, algo=algo)
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if size != meta.get("size"):
            problems.append(f"{rel}: size {size}, recorded {meta.get('size')}")
        elif want is not None and digest != want:
            problems.append(f"{rel}: {algo} mismatch (file corrupted)")
    return problems
