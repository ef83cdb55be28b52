"""hsx_client.corpus.workers' parent (WorkerPool) with stand-in worker processes (tests/_fake_workers):
the one manifest writer, every sample once when a worker is SIGKILLed, a resumable stop when
workers keep dying or report an error, a stop request; the --workers default and flag.
The real worker (HsxClient + RunLoop against `hsx serve`) is tests/e2e/test_extract_workers_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from hsx_client.corpus import journal, store
from hsx_client.corpus.cli import build_extract_parser
from hsx_client.corpus.progress import Progress
from hsx_client.corpus.run import RunHooks, RunState
from hsx_client.settings import ClientSettings, default_workers
from hsx_client.corpus.workers import RESTARTS, WorkerError, WorkerPool, WorkerSpec
from _fake_workers import Sample, fake_worker

N = 40


def run_pool(tmp_path, workers=2, stop_after=None, **behaviour):
    out = tmp_path / "out"
    out.mkdir()
    keys = [f"k{i}" for i in range(N)]
    with journal.JsonlLog(out / store.MANIFEST_NAME) as manifest, journal.JsonlLog(out / store.FAILED_NAME) as failed:
        st = RunState(client=None, fmt=None, ctx=None, out=out, settings=behaviour, served_layers=[], keys=keys,
                      by_key={k: Sample(k, {}) for k in keys}, manifest=manifest, failed_log=failed, done={},
                      failed={}, progress=Progress(N, quiet=True))
        spec = WorkerSpec(client=ClientSettings.given([]), corpus=dict(out=out, settings=behaviour), concurrency=2, write_workers=2)
        hooks = RunHooks(on_stored=lambda st, i, e: len(st.done) == stop_after and pool.request_stop("interrupted"),
                         on_start=lambda st: st.settings.setdefault("started_at", (time.monotonic(), len(st.done))))
        pool = WorkerPool(st, spec, workers=workers, hooks=hooks, target=fake_worker)
        asyncio.run(pool.run(list(range(N))))
    lines = [json.loads(x)["index"] for x in (out / store.MANIFEST_NAME).read_text().splitlines()]
    assert len(lines) == len(set(lines)), "a sample recorded twice"
    assert sorted(lines) == sorted(st.done)
    return st, pool, lines


@pytest.mark.slow  # > 2 s without an engine
def test_every_sample_once_across_workers(tmp_path):
    st, pool, lines = run_pool(tmp_path, workers=3)
    assert sorted(lines) == list(range(N)) and st.fatal is None and pool.deaths == 0
    assert st.progress.samples == N
    assert st.worker_stats == {"u": {"ok": N, "healthy": True}} and st.store_s == pytest.approx(1.5)
    assert st.life_s == pytest.approx(2.25)  # the bench's profile: every worker's books reach the parent


@pytest.mark.slow  # > 2 s without an engine
def test_the_clock_starts_once_every_worker_is_ready(tmp_path):
    """on_start (hsx bench's t0) waits for the worker processes' start-up, so a run's
    figure is its requests' time, as with the in-process loop; then every sample is done."""
    t0 = time.monotonic()
    st, pool, lines = run_pool(tmp_path, workers=3, start_delay=1.0)
    started_at, done_then = st.settings["started_at"]
    assert started_at - t0 >= 1.0 and done_then == 0
    assert sorted(lines) == list(range(N))


@pytest.mark.slow  # worker processes killed and replaced: seconds each
@pytest.mark.parametrize("unsent", [False, True], ids=["after-its-line", "files-written-no-line"])
def test_a_sigkilled_worker_is_replaced_and_nothing_is_lost_or_doubled(tmp_path, unsent):
    st, pool, lines = run_pool(tmp_path, die_after=5, die_once=True, unsent=unsent)
    assert pool.deaths == 1 and st.fatal is None and not st.stopping
    assert sorted(lines) == list(range(N))


@pytest.mark.slow
def test_a_dead_worker_s_half_written_files_go_at_once(tmp_path):
    """A worker killed mid-write leaves a temporary file; a run that completes leaves none
    (the parent removes the dead pid's, the other workers' writes go on)."""
    st, pool, lines = run_pool(tmp_path, die_after=5, die_once=True, unsent=True, half_written=True)
    assert pool.deaths == 1 and sorted(lines) == list(range(N))
    assert not [p for p in (tmp_path / "out").rglob("*") if store.TMP_MARK in p.name]


@pytest.mark.slow  # > 2 s without an engine
def test_workers_that_keep_dying_stop_the_run_resumable(tmp_path):
    st, pool, lines = run_pool(tmp_path, die_after=2)
    assert pool.deaths > RESTARTS
    assert isinstance(st.fatal, WorkerError) and "rerun the same command" in str(st.fatal)
    assert st.stopping and len(lines) < N


@pytest.mark.slow  # worker processes / a fresh interpreter: seconds each
def test_a_worker_error_stops_the_run(tmp_path):
    st, pool, lines = run_pool(tmp_path, error="servers unreachable: nobody answers")
    assert isinstance(st.fatal, WorkerError) and str(st.fatal) == "servers unreachable: nobody answers"
    assert pool.deaths == 0 and not lines


@pytest.mark.slow  # worker processes / a fresh interpreter: seconds each
def test_a_stop_request_ends_every_worker_with_what_they_stored(tmp_path):
    st, pool, lines = run_pool(tmp_path, stop_after=4, slow=0.05)
    assert st.stopping and st.stop_reason == "interrupted" and st.fatal is None
    assert 4 <= len(lines) < N and pool.deaths == 0


def test_default_workers_follow_the_core_count():
    assert [default_workers(c) for c in (1, 2, 3, 4, 8, 16, 128)] == [1, 1, 3, 4, 8, 16, 16]


def test_workers_flag_and_help():
    p = build_extract_parser()
    assert p.parse_args(["--output", "x", "--workers", "3"]).workers == 3
    assert p.parse_args(["--output", "x"]).workers == default_workers()
    assert "--workers" in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--output", "x", "--workers", "0"])


def test_one_worker_is_the_in_process_loop_and_a_test_transport_stays_in_process(tmp_path):
    from types import SimpleNamespace

    from hsx_client.corpus.extract import ConfigError, ExtractConfig, Extractor
    from hsx_client.corpus.run import RunLoop

    client = SimpleNamespace(servers=["http://x"])
    st = SimpleNamespace(**{f: None for f in ("fmt", "ctx", "out", "settings", "served_layers", "keys")})
    assert type(Extractor(ExtractConfig(client=ClientSettings.given(["http://x"]), output=tmp_path))._loop(st, client)) is RunLoop
    two = ExtractConfig(client=ClientSettings.given(["http://x"]), output=tmp_path, workers=2)
    assert type(Extractor(two)._loop(st, client)) is WorkerPool
    with pytest.raises(ConfigError, match="real connections"):
        Extractor(two, transport=object())._loop(st, client)


def test_workers_never_outnumber_the_requests_in_flight(tmp_path):
    """16 workers (the default on 16 cores) with --concurrency-per-server 8 start 8, one request
    each: the requests in flight stay what the user set. With 1 in flight, the in-process loop."""
    from types import SimpleNamespace

    from hsx_client.corpus.extract import ExtractConfig, Extractor
    from hsx_client.corpus.run import RunLoop
    from hsx_client.corpus.workers import worker_count

    assert [worker_count(16, c) for c in (1, 2, 8, 16, 64)] == [1, 2, 8, 16, 16]
    client = SimpleNamespace(servers=["http://x", "http://y"])
    st = SimpleNamespace(**{f: None for f in ("fmt", "ctx", "out", "settings", "served_layers", "keys")})
    pool = Extractor(ExtractConfig(client=ClientSettings.given(client.servers, concurrency_per_server=8),
                                   output=tmp_path, workers=16))._loop(st, client)
    assert type(pool) is WorkerPool and pool.workers == 8
    assert pool.spec.client.concurrency_per_server == 1 and pool.spec.concurrency == 2
    one = ExtractConfig(client=ClientSettings.given(client.servers, concurrency_per_server=1), output=tmp_path, workers=16)
    assert type(Extractor(one)._loop(st, client)) is RunLoop
