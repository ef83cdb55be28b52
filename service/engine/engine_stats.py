"""What vLLM's engine reports after each step, kept for /metrics.

vLLM's public hook for this is a custom stat logger passed to AsyncLLM
(`stat_loggers=[factory]`); it is called in the API process with each step's
SchedulerStats. hsx keeps the KV-cache usage (with extraction every request
holds KV blocks until its states are copied, so a leak shows here before the
engine stalls) and the engine's token counts of each step's IterationStats: prompt
tokens *computed* (prefilled, prefix-cache hits left out), prompt tokens served from
the prefix cache, and generated tokens. Computed prompt tokens are what a prefill
costs, so they are the measure of one-pass regeneration (client/regenerate/one_pass.py):
its capture request is a prefix-cache hit but for the conversation's last block.
"""

from __future__ import annotations

from typing import Any

from hsx_service.engine import vllm_compat


class EngineStats:
    def __init__(self) -> None:
        self._kv_usage: dict[int, float] = {}  # engine index (DP rank) -> last reported fraction
        self._kv_peak = 0.0
        # Totals since start over all engines: prompt tokens computed, served from the
        # prefix cache, and generated (as vLLM's IterationStats counts them).
        self.tokens = {"prompt_computed": 0, "prompt_cached": 0, "generation": 0}

    def kv_cache_usage(self) -> float:
        """The fullest engine's KV-cache usage, 0..1 (0 before the first step)."""
        return max(self._kv_usage.values(), default=0.0)

    def kv_cache_usage_peak(self) -> float:
        """The highest usage any engine reported since start. Usage changes every step
        (tens of ms) and a scrape samples one instant, often between waves of prefills when
        it is 0; the peak is what sizing KV space or --max-num-seqs needs."""
        return self._kv_peak

    def count_tokens(self, iteration_stats: Any) -> None:
        computed, cached = vllm_compat.prompt_tokens(iteration_stats)
        self.tokens["prompt_computed"] += computed
        self.tokens["prompt_cached"] += cached
        self.tokens["generation"] += int(getattr(iteration_stats, "num_generation_tokens", 0) or 0)

    def logger_factory(self) -> type:
        """A StatLoggerBase subclass vLLM instantiates once per engine: (vllm_config, engine_index)."""
        stats = self

        class HsxStatLogger(vllm_compat.stat_logger_base()):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                self.engine_index = engine_index

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    usage = vllm_compat.kv_cache_usage(scheduler_stats)
                    if usage is not None:
                        stats._kv_usage[self.engine_index] = usage
                        stats._kv_peak = max(stats._kv_peak, usage)
                if iteration_stats is not None:
                    stats.count_tokens(iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return HsxStatLogger
