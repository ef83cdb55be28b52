"""The exit codes of every hsx command (`hsx serve`, `extract`, `merge`, `verify`,
`regenerate`, `bench`, the tools), one meaning each:

    0    OK           the work is done (serve: stopped cleanly after a drain)
    1    FAILED       the work was tried and did not all succeed: a run stopped on an error
                      or finished with failed samples / conversations (rerun the same
                      command to resume); serve: the engine died; bench: a mode failed
    2    REFUSED      refused before any work: usage, settings, pre-flight, a locked or
                      unwritable directory (argparse's own usage errors exit 2 too)
    130  INTERRUPTED  stopped by SIGINT (128 + 2, the shell's convention); rerun to resume

A command's own help says what each means for it (`hsx extract --help`: extract.EXIT_CODES).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    REFUSED = 2
    INTERRUPTED = 130
