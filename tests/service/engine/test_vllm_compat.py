"""vllm_compat answers the version questions; cpu_threads splits cores for TP on CPU;
EngineStats keeps what vLLM's stat logger reports. Fast, no engine."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from hsx_service.engine import vllm_compat
from hsx_service.engine.cpu_threads import (ENV, RESERVED_ENV, bind_cpu_workers, cpu_ids, numa_nodes_with,
                                            reserve_cores_as_without_connector, split_cores)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize("version, ok", [
    ("0.25.1", False), ("0.26.0", True), ("0.27.1", True), ("0.33.1", True),
    ("0.33.0rc1.dev5+g1234", True), ("0.34.0", False), ("1.0.0", False),
])
def test_supported_range(version, ok):
    assert vllm_compat.is_supported(version) is ok


@pytest.mark.parametrize("version, ok", [
    ("0.26.0", False), ("0.30.2", False), ("0.31.0rc1", True), ("0.31.0", True), ("0.33.0", True),
])
def test_tensor_parallel_from_0_31(version, ok):
    assert vllm_compat.supports_tp(version) is ok


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_flexible_parser_is_vllms():
    parser = vllm_compat.flexible_parser()()
    assert type(parser).__name__ == "FlexibleArgumentParser"


def test_kv_cache_usage_read_from_scheduler_stats():
    assert vllm_compat.kv_cache_usage(SimpleNamespace(kv_cache_usage=0.25)) == 0.25
    assert vllm_compat.kv_cache_usage(SimpleNamespace()) is None


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_engine_stats_logger_keeps_the_fullest_engine():
    from hsx_service.engine.engine_stats import EngineStats

    stats = EngineStats()
    assert stats.kv_cache_usage() == 0.0
    cls = stats.logger_factory()
    a, b = cls(None, 0), cls(None, 1)
    a.record(SimpleNamespace(kv_cache_usage=0.5), None)
    b.record(SimpleNamespace(kv_cache_usage=0.125), None, None, 1)
    b.record(None, None)  # a step without scheduler stats changes nothing
    assert stats.kv_cache_usage() == 0.5
    a.record(SimpleNamespace(kv_cache_usage=0.0), None)
    assert stats.kv_cache_usage() == 0.125
    assert stats.kv_cache_usage_peak() == 0.5  # kept after usage fell


def test_split_cores():
    assert split_cores([0, 1], 2) == "0|1"
    assert split_cores(list(range(16)), 2) == "0-7|8-15"
    assert split_cores([0, 1, 2, 3, 4], 2) == "0-1|2-3"  # the leftover core stays with the API process
    assert [cpu_ids(share) for share in split_cores([0, 1, 2, 4, 5], 2).split("|")] == [[0, 1], [2, 4]]
    assert split_cores([3, 1, 5, 7], 2) == "1,3|5,7"
    with pytest.raises(ValueError, match="at least 4 cores"):
        split_cores([0, 1], 4)


def _nodes(root, *cpulists):
    """A fake /sys/devices/system/node with one nodeN/cpulist per argument."""
    for i, text in enumerate(cpulists):
        (root / f"node{i}").mkdir(parents=True)
        (root / f"node{i}" / "cpulist").write_text(text + "\n")
    return str(root)


def test_numa_nodes_counted_among_allowed_cpus(tmp_path):
    d = _nodes(tmp_path, "0-3,8-11", "4-7,12-15")
    assert numa_nodes_with({0, 1}, d) == 1
    assert numa_nodes_with({0, 4}, d) == 2
    assert numa_nodes_with({0}, str(tmp_path / "absent")) == 1


def test_bind_only_where_vllm_would_refuse(tmp_path):
    one = _nodes(tmp_path / "one", "0-1")
    env: dict[str, str] = {}
    assert bind_cpu_workers(2, env, cpus={0, 1}, node_dir=one) == "0|1"
    assert env == {ENV: "0|1"}
    env = {ENV: "nobind"}  # the user's choice is kept
    assert bind_cpu_workers(2, env, cpus={0, 1}, node_dir=one) is None and env == {ENV: "nobind"}
    env = {}
    assert bind_cpu_workers(1, env, cpus={0, 1}, node_dir=one) is None and env == {}
    two = _nodes(tmp_path / "two", "0-3", "4-7")
    assert bind_cpu_workers(2, env, cpus=set(range(8)), node_dir=two) is None and env == {}  # vLLM's auto works


def test_connector_costs_no_reserved_core():
    env: dict[str, str] = {}
    assert reserve_cores_as_without_connector(1, env, arch="X86") == "1" and env == {RESERVED_ENV: "1"}
    assert reserve_cores_as_without_connector(2, {}, arch="ARM") == "2"
    assert reserve_cores_as_without_connector(2, {}, arch="POWERPC") == "1"
    env = {RESERVED_ENV: "0"}  # the user's choice is kept
    assert reserve_cores_as_without_connector(1, env, arch="X86") is None and env == {RESERVED_ENV: "0"}


def _omp_manager_reserve(kv_transfer_config):
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None, _api_process_count=1)
    return OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=kv_transfer_config)
                             ).reserve_cpu_num


@pytest.mark.skipif(not (HAVE_VLLM and vllm_compat.is_cpu_backend()), reason="vLLM's CPU backend")
def test_vllm_reserves_for_hsx_connector_what_it_reserves_without(monkeypatch):
    """vLLM's own OpenMP manager: hsx's connector made it reserve one more core, which on 2 cores
    left the worker's threads on every core beside the busy-polling scheduler."""
    pytest.importorskip("vllm.utils.ompmultiprocessing")
    monkeypatch.delenv(RESERVED_ENV, raising=False)
    monkeypatch.setenv(ENV, "auto")
    plain, hsx = _omp_manager_reserve(None), _omp_manager_reserve({"kv_connector": "HsxConnector"})
    assert hsx > plain  # what hsx corrects; if vLLM stops doing it, the setting is moot
    env: dict[str, str] = {}
    reserve_cores_as_without_connector(1, env)
    monkeypatch.setenv(RESERVED_ENV, env[RESERVED_ENV])
    assert _omp_manager_reserve({"kv_connector": "HsxConnector"}) == plain


def test_hybrids_verified_per_backend_and_release():
    assert vllm_compat.hybrid_verified("0.32.0", "cpu", "Qwen3NextForCausalLM")
    assert not vllm_compat.hybrid_verified("0.31.0", "cpu", "Qwen3NextForCausalLM")
    assert not vllm_compat.hybrid_verified("0.32.0", "cuda", "Qwen3NextForCausalLM")
    assert not vllm_compat.hybrid_verified("0.32.0", "cpu", "NemotronHForCausalLM")


def test_check_hybrid_refuses_unverified_unless_allowed(monkeypatch):
    from hsx_service.engine.config import check_hybrid
    from hsx_service.core.errors import StartupError
    from hsx_service.settings import ServiceSettings

    monkeypatch.setattr(vllm_compat, "backend", lambda: "cuda")
    args = SimpleNamespace(enable_prefix_caching=None)
    with pytest.raises(StartupError, match=r"has not verified its hidden states on vLLM 0.33.0 \(cuda\)"):
        check_hybrid("0.33.0", "Qwen3NextForCausalLM", args, ServiceSettings())
    check_hybrid("0.33.0", "Qwen3NextForCausalLM", args, ServiceSettings(allow_unverified_hybrid=True))
    assert args.enable_prefix_caching is None  # left to vLLM off the CPU backend

    monkeypatch.setattr(vllm_compat, "backend", lambda: "cpu")
    check_hybrid("0.32.0", "Qwen3NextForCausalLM", args, ServiceSettings())
    assert args.enable_prefix_caching is False  # no Triton on CPU for hybrid prefix caching
    with pytest.raises(StartupError, match="cannot use --enable-prefix-caching"):
        check_hybrid("0.32.0", "Qwen3NextForCausalLM", SimpleNamespace(enable_prefix_caching=True), ServiceSettings())
