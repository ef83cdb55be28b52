"""`hsx demo`: the whole job on an embedded default, on CPU; a few minutes on a small CPU box
(most of it the engine's start).

Makes a small random Llama (with tokenizer and chat template), starts `hsx serve`
on it, extracts a handful of built-in chats with `hsx extract` into a speculators
corpus, verifies it, prints where everything is, and stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CHATS = [
    [("user", "What is speculative decoding?"),
     ("assistant", "A small draft model proposes tokens and the large model checks them in one pass.")],
    [("system", "You are terse."), ("user", "Capital of France?"), ("assistant", "Paris."),
     ("user", "And of Italy?"), ("assistant", "Rome.")],
    [("user", "Tell me a short story about a red ball."),
     ("assistant", "Once upon a time a little girl named Lily found a shiny red ball in the park.")],
    [("user", "Count to five."), ("assistant", "1 2 3 4 5")],
    [("user", "Why train EAGLE-3 on hidden states?"),
     ("assistant", "Because the draft predicts from the target model's own features at a few layers.")],
    [("user", "Say hello."), ("assistant", "Hello!"), ("user", "Say goodbye."), ("assistant", "Goodbye!")],
]


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535, got {text!r}")
    return port


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hsx demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="hsx-demo", help="where the model, inputs, corpus and log go (default ./hsx-demo)")
    p.add_argument("--format", default="speculators", choices=["speculators", "specforge"])
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server")
    p.add_argument("--port", type=_port, default=None, help="port of the demo's server on 127.0.0.1 (default: a free one)")
    a = p.parse_args(argv)

    from hsx_tools.tiny_model import make_tiny_llama

    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        print(f"[demo] making a random Llama (6 layers x 128 hidden) in {model}", flush=True)
        make_tiny_llama(model, num_layers=6, hidden_size=128)
    inputs = work / "chats.jsonl"
    with inputs.open("w") as f:
        for chat in CHATS:
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in chat]}) + "\n")

    from hsx_tools.server_process import ServerProcess, ServerStartError

    log = work / "server.log"
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = ["--dtype", "float32", "--layers", "1,2,4,6", "--max-model-len", "1024", "--arena-bytes", str(256 << 20)]
    server = ServerProcess(str(model), *args, log_path=log, env=env, port=a.port)
    print(f"[demo] starting: {' '.join(server.cmd[2:])}  (log: {log})", flush=True)
    try:
        t0 = time.monotonic()
        try:
            server.wait_ready(a.timeout)
        except ServerStartError as exc:
            raise SystemExit(f"{exc}\nlog: {log}") from None
        print(f"[demo] server ready in {time.monotonic() - t0:.0f}s at {server.url}", flush=True)
        from hsx_client.corpus.cli import extract_main, verify_main

        out = work / f"corpus-{a.format}"
        rc = extract_main(["--server", server.url, "--input", str(inputs), "--output", str(out), "--format",
                           a.format, "--draft-vocab-size", "64", "--quiet"])
        if rc != 0:
            print(f"[demo] hsx extract exited with {rc}", file=sys.stderr)
            return rc
        rc = verify_main([str(out), "--quiet"])
        print(f"[demo] corpus: {out} (verify exit {rc})")
        # The demo's server stops below: name a command that starts one, not its port.
        print(f"[demo] the demo server is stopped now; to serve the same model yourself:\n"
              f"  VLLM_CPU_KVCACHE_SPACE=1 hsx serve {model} {' '.join(args)} --port 8001\n"
              f"  curl -s -H 'Content-Type: application/json' -d '{{\"prompt\": \"Hello\"}}' "
              f"http://localhost:8001/hidden_states -o x.safetensors")
        return rc
    finally:
        server.stop(60)
