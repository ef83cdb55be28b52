"""(c)'s client in its own process tree: `python -m hsx_tools.bench.client_proc SPEC OUT`.

The issue's target measures a client that shares nothing with the server but the TCP
socket (loopback standing in for the network): no event loop, GIL or allocator of the
bench process. SPEC (JSON, written by mode_c) holds what `_measure_extract` needs; the
result (the same dict as in-process) goes to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace


class _Remote:
    """The running server as the client process sees it: a URL and a log to quote."""

    def __init__(self, url: str, log_path: str) -> None:
        self.url = url
        self.log_path = Path(log_path)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def main(argv: list[str]) -> int:
    from hsx_tools.bench.mode_c import _measure_extract
    from hsx_client.malloc_tuning import keep_large_blocks

    keep_large_blocks()  # as `hsx extract` does: this process stands in for it

    spec = json.loads(Path(argv[0]).read_text())
    res = _measure_extract(spec["ctx"], SimpleNamespace(**spec["args"]), _Remote(spec["url"], spec["server_log"]),
                           Path(spec["inputs"]), Path(spec["out_dir"]), spec["prompts"], spec["transfer"],
                           spec["timeout"])
    Path(argv[1]).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
