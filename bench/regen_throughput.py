#!/usr/bin/env python
"""Generation throughput of `hsx regenerate` on hsx serve's engine against plain vLLM:
`python bench/regen_throughput.py --model M [--engine-args "..."] [flags]`.

On the same model, engine flags and conversations (default: the shared OASST threads):
  1. `vllm serve M FLAGS`, then `hsx regenerate --server it` (plain vLLM generation, with
     token ids through its return_token_ids): generated tokens/s;
  2. `hsx serve M FLAGS` (its engine carries the capture connector and the
     extract_hidden_states speculative config), then the same `hsx regenerate`: tokens/s,
     and the ratio to 1 (issue 28's target: >= 0.95);
  3. the chained `hsx extract` of 2's output on the same server (its prefill hits the
     prefix cache): seconds and prefill tokens/s, the extra cost of --extract-to;
  4. with --spec-arm: `vllm serve M FLAGS --speculative-config` of the extract_hidden_states
     method as hsx serve sets it (no connector, no hsx code): if it is as slow as 2, the
     cost is vLLM's method, not hsx (bench/regen_spec_cost.py splits it further).
Greedy (temperature 0) so both engines generate the same replies where they are
deterministic; each server is started, measured after an untimed warm-up, and stopped.
Prints a table; `--out FILE` writes every figure as JSON. Made for the H200 (shared/gpu-kit);
on CPU use a small model and few conversations.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "fixtures"
THREADS = SHARED / "chat" / "oasst" / "threads.messages.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, path: str, timeout: float) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready in {timeout}s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def hsx_speculative_config(model: str) -> dict:
    """The speculative config hsx serve gives its engine (service/engine/config.py), on the
    default capture layers."""
    from transformers import AutoConfig

    from hsx.layers import default_layers

    cfg = AutoConfig.from_pretrained(model)
    n = int(getattr(cfg, "text_config", cfg).num_hidden_layers)
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": default_layers(n)}}}


def regenerate(url: str, inputs: Path, out: Path, args: argparse.Namespace, model: str | None,
               limit: int) -> dict:
    argv = [sys.executable, "-m", "hsx_tools.cli", "regenerate", "--server", url, "--input", str(inputs), "--output", str(out),
            "--max-tokens", str(args.max_tokens), "--temperature", "0", "--json", "--quiet",
            "--concurrency-per-server", str(args.concurrency), "--max-conversations", str(limit)]
    if model:
        argv += ["--model", model]
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"hsx regenerate exited {r.returncode}: {r.stderr[-2000:]}")
    summary = json.loads(r.stdout.splitlines()[-1])
    summary["wall_s"] = wall
    return summary


def measure(server: Server, args, tmp: Path, name: str, model: str | None) -> dict:
    regenerate(server.url, args.input, tmp / f"{name}-warmup.jsonl", args, model, args.warmup)
    return regenerate(server.url, args.input, tmp / f"{name}.jsonl", args, model, args.conversations)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--engine-args", default="", help="vLLM engine flags given to both servers, one string")
    p.add_argument("--input", type=Path, default=THREADS)
    p.add_argument("--conversations", type=int, default=512)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=128, help="requests in flight")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a server may take to start")
    p.add_argument("--spec-arm", action="store_true",
                   help="also measure vllm serve with hsx's speculative config (extract_hidden_states)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    flags = shlex.split(args.engine_args)
    results: dict = {"model": args.model, "engine_args": args.engine_args, "conversations": args.conversations,
                     "max_tokens": args.max_tokens, "concurrency": args.concurrency}
    with tempfile.TemporaryDirectory(prefix="hsx-regen-bench-") as d:
        tmp = Path(d)
        port = free_port()
        # vLLM's OpenAI server module: the `vllm` script needs the package's metadata (absent
        # from some CPU builds)
        vllm = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port", str(port), *flags], port, tmp / "vllm.log")
        try:
            vllm.wait("/health", args.timeout)
            results["vllm"] = measure(vllm, args, tmp, "vllm", args.model)
        finally:
            vllm.stop()
        if args.spec_arm:
            port = free_port()
            spec = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port",
                           str(port), *flags, "--speculative-config", json.dumps(hsx_speculative_config(args.model))],
                          port, tmp / "vllm-spec.log")
            try:
                spec.wait("/health", args.timeout)
                results["vllm_extract_hidden_states"] = measure(spec, args, tmp, "vllm-spec", args.model)
            finally:
                spec.stop()
        port = free_port()
        hsx = Server([sys.executable, "-m", "hsx_tools.cli", "serve", args.model, "--port", str(port), *flags], port,
                     tmp / "hsx.log")
        try:
            hsx.wait("/ready", args.timeout)
            results["hsx"] = measure(hsx, args, tmp, "hsx", None)
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "hsx_tools.cli", "extract", "--server", hsx.url, "--input",
                                str(tmp / "hsx.jsonl"), "--output", str(tmp / "corpus"), "--format", "speculators",
                                "--json", "--quiet"], capture_output=True, text=True, check=False)
            results["chained_extract"] = {"wall_s": time.perf_counter() - t, "exit_code": r.returncode,
                                          "summary": json.loads(r.stdout) if r.returncode == 0 else r.stderr[-2000:]}
        finally:
            hsx.stop()
    v, h = results["vllm"]["generated_tokens_per_s"], results["hsx"]["generated_tokens_per_s"]
    results["ratio_hsx_to_vllm"] = h / v if v else None
    print(f"plain vLLM serve : {v:12,.0f} generated tok/s ({results['vllm']['generated_tokens']} tokens)")
    print(f"hsx serve        : {h:12,.0f} generated tok/s ({results['hsx']['generated_tokens']} tokens)")
    print(f"ratio            : {results['ratio_hsx_to_vllm']:.3f} (target >= 0.95)")
    print(f"chained extract  : {results['chained_extract']['wall_s']:.1f} s")
    if "vllm_extract_hidden_states" in results:
        e = results["vllm_extract_hidden_states"]["generated_tokens_per_s"]
        results["ratio_vllm_extract_hidden_states_to_vllm"] = e / v if v else None
        results["ratio_hsx_to_vllm_extract_hidden_states"] = h / e if e else None
        print(f"vLLM serve + extract_hidden_states: {e:,.0f} generated tok/s "
              f"(ratio to plain {results['ratio_vllm_extract_hidden_states_to_vllm']:.3f}; "
              f"hsx to it {results['ratio_hsx_to_vllm_extract_hidden_states']:.3f})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
