"""`hsx bench`: hsx end to end against plain vLLM prefill and vLLM's own file connector.

One command, one model, one prompt set, one set of engine flags, three modes run one
after the other, each with its own engine (start, warm up, measure, shut down):

  (a) plain prefill: `vllm.LLM.generate` of every prompt with max_tokens=1, no
      extraction. The ceiling.
  (b) vLLM's built-in path: the `extract_hidden_states` speculative method with the stock
      `ExampleHiddenStatesConnector` writing one safetensors file per request (to
      /dev/shm when it has room), then every file read back with vLLM's own
      `load_hidden_states` (it waits on the `.lock`) and removed. What users have today.
      On the CPU backend the stock connector cannot run (pinned memory, CUDA streams):
      `hsx_tools.bench_cpu_connector` is the same connector with a synchronous copy.
  (c) hsx end to end: `hsx serve` in a subprocess, the hsx client's real `extract` run
      loop over HTTP (zstd decoding, checks) writing a speculators corpus to disk,
      every sample fsync'ed and recorded; finalize (the datasets table) timed apart.

(a) and (b) run in child processes (`python -m hsx_tools.bench --worker CONFIG`), (c)'s
server is a child too, so each mode's engine and accelerator memory are gone before
the next starts; the client of (c) runs in this process. Prefix caching is off in every
mode. Only the measured phase is timed, after a warm-up on other prompts of the same
length. Prompts are random token ids of one length from a seed (vocab from the model's
config.json).

Printed: tokens/s, GB/s of hidden states (tokens x layers x hidden x bytes per element /
s), wire bytes vs raw bytes, peak RSS of each engine's process tree and of the client
(psutil), and the ratios (c)/(a), (c)/(b). `--out FILE` writes every figure, the
settings, the hardware and the versions as JSON.

Modules: cli (flags, presets, the run), engines ((a), (b)), mode_c, report (table,
ratios), memory, common; the codec study (`--codec-only`, `python bench/codec.py`) is
codec.
"""

from hsx_tools.bench.cli import main

__all__ = ["main"]
