"""Settings that cannot work are refused at start, with the reason."""

from __future__ import annotations

import subprocess

import pytest

from _server import engine_env, serve_command
from _server import serve_once as _serve
from hsx.layers import default_layers
from hsx_service.engine.config import check_parallelism, check_vllm_version, resolve_layers
from hsx_service.core.errors import StartupError


def test_default_layers():
    assert default_layers(32) == [2, 16, 29, 32]
    assert default_layers(16) == [2, 8, 13, 16]
    for n in range(8, 129):  # speculators' convention exactly
        assert default_layers(n) == [2, n // 2, n - 3, n]
    # Shallow models: collisions filled with the smallest unused id >= 1, then 0, so
    # every model with N >= 3 gets a valid EAGLE-3 set (3 distinct aux ids < N, plus N).
    assert default_layers(7) == [2, 3, 4, 7]
    assert default_layers(6) == [1, 2, 3, 6]
    assert default_layers(5) == [1, 2, 3, 5]  # the stories260K fixture: was [2, 5]
    assert default_layers(4) == [1, 2, 3, 4]
    assert default_layers(3) == [0, 1, 2, 3]
    for n in range(3, 129):
        ids = default_layers(n)
        assert len(set(ids[:3])) == 3 and all(0 <= k < n for k in ids[:3]) and ids[3] == n
    # Below that: what exists (the client refuses EAGLE-3 formats before any sample).
    assert default_layers(2) == [0, 1, 2]
    assert default_layers(1) == [0, 1]


def test_layers_outside_range_refused():
    assert resolve_layers([16, 2, 29, 32], 32) == [2, 16, 29, 32]
    with pytest.raises(StartupError, match=r"\[33\] are outside 0..32"):
        resolve_layers([2, 33], 32)
    with pytest.raises(StartupError, match="outside"):
        resolve_layers([-1], 32)


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "0.10.0", "1.0.0"])
def test_unsupported_vllm_versions(version):
    with pytest.raises(StartupError, match=f"vLLM {version} is not supported"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.26.0", "0.30.2", "0.32.0", "0.33.1", "0.33.0rc1.dev5+g1234"])
def test_supported_vllm_versions(version):
    check_vllm_version(version)


def test_parallelism_rules():
    with pytest.raises(StartupError, match="pipeline parallel"):
        check_parallelism("0.32.0", 1, 2)
    with pytest.raises(StartupError, match="needs vLLM >= 0.31"):
        check_parallelism("0.30.0", 2, 1)
    check_parallelism("0.31.0", 4, 1)
    check_parallelism("0.26.0", 1, 1)
    with pytest.raises(StartupError, match="--data-parallel-size 2 needs vLLM >= 0.31"):
        check_parallelism("0.30.0", 1, 1, 2)
    check_parallelism("0.32.0", 2, 1, 2)


# Settings `hsx serve` refuses before any engine starts. Each case is its own process
# (each imports vLLM: 10-20 s on a 2-core box), so they all start at once on first use.
REFUSED = {
    "layer_out_of_range": lambda model, tmp: [model, "--layers", "2,7"],
    "pipeline_parallel": lambda model, tmp: [model, "--pipeline-parallel-size", "2"],
    "no_eagle3_interface": lambda model, tmp: [str(tmp)],
    "missing_model": lambda model, tmp: ["/no/such/model"],
}


@pytest.fixture(scope="module")
def refusals(tiny_model, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install '.[cpu]')")
    from transformers import GPT2Config

    gpt2 = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100).save_pretrained(gpt2)
    procs = {
        # all at once (each is a start-up refused in seconds), not serve_once one after another
        name: subprocess.Popen(serve_command(*argv(str(tiny_model), gpt2)), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=engine_env())
        for name, argv in REFUSED.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@pytest.mark.engine
def test_serve_refuses_layer_out_of_range(refusals):
    r = refusals["layer_out_of_range"]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "outside 0..6" in r.stderr


@pytest.mark.engine
def test_serve_refuses_pipeline_parallel(refusals):
    r = refusals["pipeline_parallel"]
    assert r.returncode == 2 and "pipeline parallel" in r.stderr, r.stderr[-2000:]


@pytest.mark.compat
@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--data-parallel-size"])
def test_serve_refuses_parallel_before_0_31(request, flag):
    from hsx_service.engine import vllm_compat

    version = pytest.importorskip("vllm", reason="vLLM is not installed").__version__
    if vllm_compat.supports_tp(version):
        pytest.skip(f"vLLM {version} allows {flag} 2 (test_parallel.py runs it)")
    r = _serve(str(request.getfixturevalue("tiny_model")), flag, "2")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{flag} 2 needs vLLM >= 0.31" in r.stderr and version in r.stderr


@pytest.mark.engine
def test_serve_refuses_architecture_without_eagle3_interface(refusals):
    r = refusals["no_eagle3_interface"]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "does not implement vLLM's EAGLE-3" in r.stderr and "GPT2" in r.stderr


@pytest.mark.engine
def test_serve_refuses_missing_model(refusals):
    r = refusals["missing_model"]
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr[-2000:]


def test_settings_from_environment(monkeypatch):
    from hsx_service.settings import ServiceSettings

    monkeypatch.setenv("HSX_LAYERS", "2, 8,13,16")
    monkeypatch.setenv("HSX_API_KEY", "k1,k2")
    monkeypatch.setenv("HSX_PORT", "9001")
    s = ServiceSettings()
    assert s.layers == [2, 8, 13, 16] and s.api_key == ["k1", "k2"] and s.port == 9001
    assert ServiceSettings(port=9002).port == 9002  # a flag wins over the environment


def test_byte_settings_take_units(monkeypatch):
    """`--arena-bytes 16MiB` as the client's `--max-buffer-bytes 512MiB` (a bare count still works);
    a size that means nothing is refused, naming the setting."""
    from pydantic import ValidationError

    from hsx_service.settings import ServiceSettings

    monkeypatch.setenv("HSX_ARENA_BYTES", "16MiB")
    s = ServiceSettings(stream_window_bytes="1 MiB", max_body_bytes="65536", tokenize_memory="4GiB")
    assert (s.arena_bytes, s.stream_window_bytes, s.max_body_bytes, s.tokenize_memory) == (16 << 20, 1 << 20, 65536, 4 << 30)
    with pytest.raises(ValidationError, match="arena_bytes"):
        ServiceSettings(arena_bytes="lots")
    with pytest.raises(ValidationError, match="arena_bytes"):  # the floor (1 MiB) holds with units too
        ServiceSettings(arena_bytes="4KiB")


def test_a_setting_out_of_bounds_is_refused_in_one_line_naming_where_it_came_from(monkeypatch):
    """Issue 36 item 5: `--stream-window-bytes` below 64 KiB printed pydantic's report."""
    from pydantic import ValidationError

    from hsx_service.settings import ServiceSettings, refusal_line

    with pytest.raises(ValidationError) as flag:
        ServiceSettings(stream_window_bytes="1000")
    assert refusal_line(flag.value, {"stream_window_bytes": "1000"}) == \
        "--stream-window-bytes 1000: must be at least 64 KiB (65536 bytes)"
    monkeypatch.setenv("HSX_STREAM_WINDOW_BYTES", "4KiB")
    monkeypatch.setenv("HSX_PORT", "x")
    with pytest.raises(ValidationError) as env:
        ServiceSettings()
    line = refusal_line(env.value, {})
    assert "\n" not in line and "HSX_STREAM_WINDOW_BYTES=4KiB: must be at least 64 KiB (65536 bytes)" in line
    assert "HSX_PORT=x: Input should be a valid integer" in line


def test_cli_flags_override_environment(monkeypatch):
    pytest.importorskip("vllm")
    from hsx_service.cli import parse

    monkeypatch.setenv("HSX_PORT", "9001")
    monkeypatch.setenv("HSX_ENGINE_ARGS", "--max-model-len 256 --dtype float32")
    settings, engine_args = parse(["some/model", "--port", "9005", "--layers", "1,2", "--shutdown-timeout", "7"])
    assert settings.port == 9005 and settings.layers == [1, 2] and settings.shutdown_timeout == 7
    assert engine_args.max_model_len == 256 and engine_args.dtype == "float32"
    assert engine_args.model == "some/model"
