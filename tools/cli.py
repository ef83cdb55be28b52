"""The `hsx` command: one entry point, each subcommand lives with its side.

`serve` and `bench` import vLLM; `extract`, `verify` and `merge` do not, so the
client installs and runs without it.
"""

from __future__ import annotations

import sys

from hsx.exit_codes import ExitCode
from hsx_tools.tiny_model import FAMILIES  # light: the maker imports transformers only when it runs

if "__mp_main__" in sys.modules:
    # A process that multiprocessing spawned from `hsx` (it imports the parent's main module
    # first): vLLM's data-parallel coordinator is one, and no vLLM plugin runs there to hold
    # the lifeline, so it outlived a SIGKILLed `hsx serve --data-parallel-size 2`.
    from hsx import lifeline

    lifeline.hold()

USAGE = f"""usage: hsx COMMAND [ARGS]

commands:
  serve MODEL [vLLM engine flags] [hsx flags]   run the extraction server
  extract --server URL --input FILE --output DIR  write a training corpus
  verify DIR                                      re-check a corpus
  regenerate --server URL --input FILE --output PATH  the target's own answers to a chat dataset
  merge OUT SHARD_DIR...                          one corpus from the shards of `extract --shard I/N`
  demo                                            tiny CPU model + server + extract, end to end
  bench                                           benchmark against plain prefill and vLLM's file path
  make-tiny-model DIR [--family F]                write a small random model ({", ".join(FAMILIES)})
  quantize-tiny-model SRC DST --scheme S          FP8-block or W4A16 copy of a small model, and its dequantized twin

`hsx COMMAND --help` for a command's flags.
"""


def main(argv: list[str] | None = None) -> int:
    from hsx import lifeline

    lifeline.hold()  # started by a tool that owns this process (hsx bench, hsx demo): die with it
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return ExitCode.OK
    command, rest = argv[0], argv[1:]
    if command in ("serve", "demo", "bench", "make-tiny-model", "quantize-tiny-model"):
        from hsx.compat import guard_broken_torch_extensions

        guard_broken_torch_extensions()
    if command == "serve":
        from hsx_service.cli import main as run
    elif command == "extract":
        from hsx_client.corpus.cli import extract_main as run
    elif command == "verify":
        from hsx_client.corpus.cli import verify_main as run
    elif command == "regenerate":
        from hsx_client.regenerate.cli import main as run
    elif command == "merge":
        from hsx_client.corpus.cli import merge_main as run
    elif command == "demo":
        from hsx_tools.demo import main as run
    elif command == "bench":
        from hsx_tools.bench import main as run
    elif command == "make-tiny-model":
        from hsx_tools.tiny_model import main as run
    elif command == "quantize-tiny-model":
        from hsx_tools.tiny_quant import main as run
    elif command in ("-V", "--version"):
        from hsx import __version__

        print(__version__)
        return ExitCode.OK
    else:
        print(f"hsx: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return ExitCode.REFUSED
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
