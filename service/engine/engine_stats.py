"""What vLLM's engine reports after each step, kept for /metrics.

vLLM's public hook for this is a custom stat logger passed to AsyncLLM
(`stat_loggers=[factory]`); it is called in the API process with each step's
SchedulerStats. hsx keeps only the KV-cache usage: with extraction every request
holds KV blocks until its states are copied, so a leak shows here before the
engine stalls.
"""

from __future__ import annotations

from typing import Any

from hsx_service.engine import vllm_compat


class EngineStats:
    def __init__(self) -> None:
        self._kv_usage: dict[int, float] = {}  # engine index (DP rank) -> last reported fraction
        self._kv_peak = 0.0

    def kv_cache_usage(self) -> float:
        """The fullest engine's KV-cache usage, 0..1 (0 before the first step)."""
        return max(self._kv_usage.values(), default=0.0)

    def kv_cache_usage_peak(self) -> float:
        """The highest usage any engine reported since start. Usage changes every step
        (tens of ms) and a scrape samples one instant, often between waves of prefills when
        it is 0; the peak is what sizing KV space or --max-num-seqs needs."""
        return self._kv_peak

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

            def log_engine_initialized(self) -> None:
                pass

        return HsxStatLogger
