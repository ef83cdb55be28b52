"""Prometheus metrics, one registry per app (no module globals)."""

from __future__ import annotations

import asyncio

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.core import CounterMetricFamily


LOOP_LAG_INTERVAL = 0.1


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hsx_requests", "Finished /hidden_states requests", ["status"], registry=r)
        self.rejected = Counter(
            "hsx_rejected", "Requests refused (503 full/draining, 408 slow body, 413 too large, 431 headers)",
            ["reason"], registry=r,
        )
        self.responses = Counter("hsx_http_responses", "HTTP answers on every route, by status code", ["code"],
                                 registry=r)
        self.connections_open = Gauge("hsx_connections_open", "HTTP connections open (this process)", registry=r)
        self.connections_shed = Counter(
            "hsx_connections_shed", "Connections closed by the server before a request: header_timeout, evicted "
            "(idle, at --max-connections), refused (at --max-connections, all busy)", ["reason"], registry=r,
        )
        self.receiving = Gauge("hsx_receiving_requests", "Requests whose body is still arriving", registry=r)
        self.tokens = Counter("hsx_tokens", "Prompt tokens whose states were returned", registry=r)
        self.raw_bytes = Counter("hsx_hidden_state_bytes", "Response bytes before compression", registry=r)
        self.wire_bytes = Counter("hsx_response_bytes", "Response bytes sent (after compression)", registry=r)
        self.compression_ratio = Gauge(
            "hsx_compression_ratio", "Raw over wire bytes, all responses so far", registry=r
        )
        self.inflight = Gauge("hsx_inflight_requests", "Requests admitted and not finished", registry=r)
        self.queued_tokens = Gauge("hsx_queued_tokens", "Prompt tokens of admitted requests", registry=r)
        self.engine_running = Gauge("hsx_engine_requests", "Requests inside the vLLM engine", registry=r)
        # Fed by vLLM's stat logger after each engine step (engine_stats.py); idle is 0.
        self.kv_cache_usage = Gauge(
            "hsx_kv_cache_usage", "Fraction of vLLM's KV-cache blocks in use (0..1), fullest engine", registry=r
        )
        self.kv_cache_usage_peak = Gauge(
            "hsx_kv_cache_usage_peak", "Highest hsx_kv_cache_usage any engine step reported since start", registry=r
        )
        self.arena_used = Gauge("hsx_arena_used_bytes", "Shared-memory arena bytes held by requests", registry=r)
        self.leases = Counter(
            "hsx_leases", "Same-host leases: granted, released, expired, unsent, client_gone, shutdown; refused_session / "
            "refused_arena (over a session's or the arena's cap: an HTTP body instead)", ["outcome"], registry=r
        )
        self.leases_live = Gauge("hsx_leases_live", "Same-host leases not yet released", registry=r)
        self.http_workers = Gauge("hsx_http_workers", "HTTP worker processes alive (--http-workers)", registry=r)
        self.latency = Histogram(
            "hsx_request_seconds",
            "Time from admission to the last body byte",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        # Where a request's time goes: wait (body read -> handler running: validation and
        # the event loop's queue), tokenize, engine (queue + prefill), copy (prefill done ->
        # the worker's copy landed in the arena), send (body serialized, compressed and
        # written to the socket).
        self.phase = Summary("hsx_phase_seconds", "Time per request phase", ["phase"], registry=r)
        # One event loop serves every request, body write and engine output of this process:
        # when it is the bottleneck, each of them waits this long (issue 17's H200 runs).
        self.loop_lag = Summary(
            "hsx_event_loop_lag_seconds",
            f"How late the API process's event loop ran a timer due every {LOOP_LAG_INTERVAL:g} s", registry=r,
        )
        self._raw_total = 0
        self._wire_total = 0

    def watch_engine_tokens(self, totals: Callable[[], dict[str, int]]) -> None:
        """Expose the engine's own token counters (engine_stats.py), read at each scrape."""
        self.registry.register(EngineTokens(totals))

    def sent(self, raw: int, wire: int) -> None:
        self.raw_bytes.inc(raw)
        self.wire_bytes.inc(wire)
        self._raw_total += raw
        self._wire_total += wire
        if self._wire_total:
            self.compression_ratio.set(self._raw_total / self._wire_total)


async def sample_loop_lag(metrics: Metrics, interval: float = LOOP_LAG_INTERVAL) -> None:
    """Runs until cancelled: observes how late each `interval` timer fires."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        metrics.loop_lag.observe(max(0.0, loop.time() - due))


class EngineTokens:
    """hsx_engine_prompt_tokens_total (computed: prefilled by the engine, prefix-cache hits
    left out), hsx_engine_prompt_cached_tokens_total (served from the prefix cache) and
    hsx_engine_generation_tokens_total: what every request on the engine cost, generation
    and /hidden_states alike (a /hidden_states prefill samples one token, counted as
    generated)."""

    HELP = {
        "prompt_computed": ("hsx_engine_prompt_tokens", "Prompt tokens the engine computed (prefix-cache hits excluded)"),
        "prompt_cached": ("hsx_engine_prompt_cached_tokens", "Prompt tokens served from the engine's prefix cache"),
        "generation": ("hsx_engine_generation_tokens", "Tokens the engine generated (sampled)"),
    }

    def __init__(self, totals: Callable[[], dict[str, int]]) -> None:
        self._totals = totals

    def collect(self):
        totals = self._totals()
        for key, (name, text) in self.HELP.items():
            family = CounterMetricFamily(name, text)
            family.add_metric([], totals.get(key, 0))
            yield family

    def describe(self):
        return [CounterMetricFamily(name, text) for name, text in self.HELP.values()]
