#!/usr/bin/env python
"""Codec measurement on real activations: `python bench/codec.py [flags]`.

The same as `hsx bench --codec-only [flags]` (the code lives in tools/bench/codec.py so
the installed `hsx` command has it too). By default it serves the shared stories260K model
and a random bf16 Llama with `hsx serve`, takes the hidden states of real text (the
shared OASST fixture), and measures each candidate on them: none, zstd -1/1/3 single
thread and threads=2, the bf16 exponent-plane split (exponent plane zstd-1 tuned as an
entropy coder, sign+mantissa raw) and the cheaper high-byte split. `--corpus DIR`
measures on an existing speculators corpus instead (e.g. the H200 one). See bench/README.md.
"""

import sys

from hsx_tools.bench.codec import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
