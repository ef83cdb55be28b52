"""Issue 17 item 3 end to end: `hsx extract --workers 2` against a real `hsx serve` (vLLM
CPU, fp32 stories260K, real chat threads), one worker process SIGKILLed mid-run: the run
completes (the parent hands the dead worker's samples to a new one), `hsx verify` passes,
every sample is in the manifest exactly once, and the corpus holds the same files with the
same checksums as an uninterrupted `--workers 1` (in-process) run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from _e2e_helpers import (
    CliProcess, assert_each_index_once, assert_verify_ok, extract_argv, manifest_lines, run_extract,
    stored_indices, wait_for_manifest,
)
from _server import CHAT

pytestmark = [pytest.mark.engine, pytest.mark.fixtures]

N = 40
RUN_FILES = {"manifest.jsonl", "failed.jsonl", "hsx_corpus.json", "plan.json", ".lock", "bad_rows.jsonl"}


def args(n: int) -> list[str]:
    return ["--format", "speculators", "--mask-policy", "per_turn", "--max-length", "256", "--truncation", "left",
            "--max-samples", str(n), "--seed", "7", "--input", str(CHAT / "oasst" / "threads.messages.jsonl"),
            "--concurrency-per-server", "2"]


def digests(out: Path) -> dict[str, str]:
    """Every file of the corpus but the run's own books (they name times and request ids);
    the table's state.json without the random fingerprint `datasets` gives every save."""
    res = {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name not in RUN_FILES:
            data = p.read_bytes()
            if p.name == "state.json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if k != "_fingerprint"}).encode()
            res[str(p.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return res


def worker_pids(pid: int) -> list[int]:
    """The extract's worker processes ('spawn' children; not multiprocessing's resource tracker)."""
    return [c.pid for c in psutil.Process(pid).children()
            if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]


def test_a_sigkilled_worker_loses_and_doubles_nothing(e2e_pool, tmp_path):
    server = e2e_pool.get(1)
    ref = tmp_path / "ref"
    summary = run_extract(server, ref, *args(N), "--workers", "1")
    assert summary["status"] == "complete" and summary["done"] == N

    out = tmp_path / "corpus"
    cp = CliProcess(extract_argv(server, out, *args(N), "--workers", "2"), tmp_path / "extract.log")
    wait_for_manifest(cp, out, 5)
    pids = worker_pids(cp.proc.pid)
    assert len(pids) == 2, f"expected 2 worker processes, found {pids}"
    os.kill(pids[0], signal.SIGKILL)
    at_kill = len(stored_indices(out))
    rc = cp.wait(180)
    assert at_kill < N, "the run finished before the kill"
    assert rc == 0, cp.output()[-3000:]
    assert "died (exit code -9)" in cp.output(), cp.output()[-3000:]

    assert_each_index_once(out, N)
    assert_verify_ok(out)
    files = {e["index"]: e["files"] for e in manifest_lines(out)}
    assert files == {e["index"]: e["files"] for e in manifest_lines(ref)}  # same files, same checksums
    assert digests(out) == digests(ref)


def test_ctrl_c_stops_the_workers_exits_130_and_resumes(e2e_pool, tmp_path):
    """SIGINT to the parent's group (as a terminal sends it): the workers ignore it, the
    parent tells them to stop, they finish their stores; exit 130, no worker left behind,
    nothing broken; the same command then completes with every sample once."""
    server = e2e_pool.get(1)
    out = tmp_path / "corpus"
    argv = extract_argv(server, out, *args(N), "--workers", "2", "--concurrency-per-server", "1")
    cp = CliProcess(argv, tmp_path / "extract.log")
    wait_for_manifest(cp, out, 3)
    pids = worker_pids(cp.proc.pid)
    os.killpg(cp.proc.pid, signal.SIGINT)
    rc = cp.wait(60)
    assert rc == 130, cp.output()[-3000:]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    stored = set(stored_indices(out))
    assert len(stored) < N, "the run finished before the interrupt"
    assert not (out / "hsx_corpus.json").exists()

    summary = run_extract(server, out, *args(N), "--workers", "2")
    assert summary["status"] == "complete" and summary["samples_this_run"] == N - len(stored)
    assert_each_index_once(out, N)
    assert_verify_ok(out)
