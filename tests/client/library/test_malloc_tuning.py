"""client/malloc_tuning.py: with large blocks kept, a second 64 MiB body reuses the first's
memory (few page faults) where glibc's default maps and faults in fresh pages each time,
on the event loop's thread (HTTP bodies) and in another thread (zstd decoding runs in the
loop's executor). Counted in page faults, not time: the same on a loaded box."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys
from concurrent.futures import ThreadPoolExecutor
from hsx_client.malloc_tuning import keep_large_blocks
kept = keep_large_blocks() if sys.argv[1] == "keep" else False
chunks = [bytes([i]) * (1 << 20) for i in range(64)]

def second_body_faults() -> int:
    body = b"".join(chunks)  # the first body: faults its pages in either way
    del body
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    body = b"".join(chunks)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

on_loop = second_body_faults()
with ThreadPoolExecutor(1) as pool:
    in_thread = pool.submit(second_body_faults).result()
print(kept, on_loop, in_thread)
"""


def faults(mode: str) -> tuple[bool, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    kept, on_loop, in_thread = out.stdout.split()
    return kept == "True", int(on_loop), int(in_thread)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_second_large_body_reuses_the_first_one_s_memory():
    kept, *reused = faults("keep")
    if not kept:
        pytest.skip("not glibc: keep_large_blocks does nothing here")
    _, *fresh = faults("default")
    pages = (64 << 20) // 4096
    for where, f, r in zip(("on the loop", "in a thread"), fresh, reused):
        assert f > pages // 2, f"glibc's default faulted only {f} pages for a fresh 64 MiB body {where}"
        assert r < pages // 20, f"{r} page faults for a body {where} that should reuse freed memory"
