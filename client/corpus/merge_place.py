"""How `hsx merge` puts a shard's sample file into OUT: a hard link, else a copy checked
against the shard's checksum (across filesystems), or a rewrite without the sample index an
older client wrote into the file (hsx_client.corpus.merge explains why links are safe)."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

from hsx_client.corpus import store
from hsx_client.corpus.merge_check import MergeError

# os.link errors that mean "this filesystem pair will not link": copy instead.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def legacy_index_header(path: Path) -> tuple[int, bytes] | None:
    """(old header length, the header without its "index") of a speculators sample file
    written before files stopped naming their sample index, else None. Such a file is
    rewritten (store.copy_file_atomic's `head`), not linked: in the merged corpus it sits
    at another index than the one it names."""
    if path.suffix != ".safetensors":
        return None
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        n = struct.unpack("<Q", head)[0]
        if n > 1 << 24:
            return None
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or "index" not in meta:
        return None
    header["__metadata__"] = {k: v for k, v in meta.items() if k != "index"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data stays 8-byte aligned, as safetensors writes it
    return 8 + n, struct.pack("<Q", len(raw)) + raw


class Placer:
    """Puts a shard's file at its new name: a hard link, else a checksummed copy."""

    def __init__(self) -> None:
        self.links = 0
        self.copies = 0
        self.rewrites = 0
        self._no_link: set[int] = set()  # st_dev of shards that cannot link into OUT

    def place(self, src: Path, dst: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """Puts the file in place; returns its manifest meta in OUT (the shard's, unless rewritten)."""
        try:
            st = os.stat(src)
        except FileNotFoundError:
            raise MergeError(f"{src} is missing (its shard's manifest lists it): rerun the shard's hsx extract") from None
        if st.st_size != meta.get("size"):
            raise MergeError(f"{src} has {st.st_size} bytes, its shard's manifest says {meta.get('size')}: "
                             "run `hsx verify` on the shard and rerun its hsx extract")
        try:
            if os.path.samestat(st, os.stat(dst)):  # linked by an earlier, interrupted run
                self.links += 1
                return meta
            os.unlink(dst)  # a copy whose manifest line was never written: redo it
        except FileNotFoundError:
            pass
        dst.parent.mkdir(parents=True, exist_ok=True)
        legacy = legacy_index_header(src)
        try:
            if legacy is not None:
                digest = store.copy_file_atomic(src, dst, expected=store.recorded_digest(meta), head=legacy)
                self.rewrites += 1
                return {"size": os.stat(dst).st_size, store.HASH_ALGO: digest}
            if st.st_dev not in self._no_link:
                try:
                    os.link(src, dst)
                    self.links += 1
                    return meta
                except OSError as exc:
                    if exc.errno not in _NO_LINK:
                        raise
                    self._no_link.add(st.st_dev)
            store.copy_file_atomic(src, dst, expected=store.recorded_digest(meta))
        except store.ChecksumError as exc:
            raise MergeError(f"{exc}: run `hsx verify` on the shard and rerun its hsx extract") from None
        self.copies += 1
        return meta
