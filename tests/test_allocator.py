"""client/allocator.py: with large blocks kept, a second 64 MiB body reuses the first's
memory (few page faults) where glibc's default maps and faults in fresh pages each time.
Counted in page faults, not time: the same on a loaded box."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys
from hsx_client.allocator import keep_large_blocks
kept = keep_large_blocks() if sys.argv[1] == "keep" else False
chunks = [bytes([i]) * (1 << 20) for i in range(64)]
body = b"".join(chunks)  # the first body: faults its pages in either way
del body
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
body = b"".join(chunks)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    kept, n = out.stdout.split()
    return kept == "True", int(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_second_large_body_reuses_the_first_one_s_memory():
    kept, reused = faults("keep")
    if not kept:
        pytest.skip("not glibc: keep_large_blocks does nothing here")
    _, fresh = faults("default")
    pages = (64 << 20) // 4096
    assert fresh > pages // 2, f"glibc's default faulted only {fresh} pages for a fresh 64 MiB body"
    assert reused < pages // 20, f"{reused} page faults for a body that should reuse freed memory"
