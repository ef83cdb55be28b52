"""The client's defaults live in one pydantic-settings class; HSX_* variables keep working."""

from __future__ import annotations

import pytest

from hsx_client.corpus import cli
from hsx_client.api import HsxClient
from hsx_client.corpus.extract import ExtractConfig
from hsx_client.settings import DEFAULTS, ClientSettings

ENV = {
    "HSX_SERVER": "http://a:8001, http://b:8001",
    "HSX_API_KEY": "k",
    "HSX_CONCURRENCY_PER_SERVER": "3",
    "HSX_TIMEOUT": "12.5",
    "HSX_MAX_ATTEMPTS": "4",
    "HSX_COMPRESSION": "none",
    "HSX_TRANSFER": "http",
}


def test_environment_gives_the_flag_defaults_and_flags_win(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HSX_PORT", "9000")  # a server variable: ignored here
    env = ClientSettings()
    assert env.server == ["http://a:8001", "http://b:8001"]
    args = cli.build_extract_parser(env).parse_args(["--output", "o"])
    assert (args.api_key, args.concurrency_per_server, args.timeout, args.max_attempts, args.compression,
            args.transfer) == ("k", 3, 12.5, 4, "none", "http")
    args = cli.build_extract_parser(env).parse_args(["--output", "o", "--timeout", "1", "--transfer", "auto"])
    assert args.timeout == 1.0 and args.transfer == "auto"


def test_one_set_of_defaults(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)  # the library's defaults never read the environment
    client = HsxClient("http://a")
    cfg = ExtractConfig(client=ClientSettings.given(["http://a"]), output="o").client
    args = cli.build_extract_parser().parse_args(["--output", "o"])
    for name in ("concurrency_per_server", "timeout", "max_attempts", "compression", "transfer"):
        assert getattr(cfg, name) == getattr(args, name) == getattr(DEFAULTS, name), name
    assert (client.timeout, client.max_attempts, client.compression, client.transfer) == (
        DEFAULTS.timeout, DEFAULTS.max_attempts, DEFAULTS.compression, DEFAULTS.transfer)
    assert client.unhealthy_cooldown == cfg.unhealthy_cooldown == DEFAULTS.unhealthy_cooldown


@pytest.mark.parametrize("name,value,words", [
    ("HSX_COMPRESSION", "gzip", "'auto', 'zstd', 'bf16split' or 'none'"),
    ("HSX_CONCURRENCY_PER_SERVER", "0", "greater than or equal to 1"),
    ("HSX_TIMEOUT", "soon", "valid number"),
])
def test_a_bad_variable_is_a_one_line_usage_error(monkeypatch, capsys, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.extract_main(["--output", "o", "--server", "http://a"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"hsx extract: {name}={value!r}: ") and words in err, err


def test_hsx_extract_passes_one_client_settings_whole(monkeypatch, tmp_path):
    """The environment, then the flags, land in ExtractConfig.client; HsxClient is built from it
    (before, each of the eight fields was copied by name in the CLI, ExtractConfig and the workers)."""
    from hsx_client.corpus import extract

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    seen = {}

    def capture(cfg):
        seen["cfg"] = cfg
        return extract.ExtractResult(0, "refused", {"message": "captured"})

    monkeypatch.setattr(extract, "run_extract", capture)
    cli.extract_main(["--output", str(tmp_path / "o"), "--max-attempts", "2", "--compression", "zstd"])
    conn = seen["cfg"].client
    assert isinstance(conn, ClientSettings)
    assert (conn.server, conn.api_key, conn.timeout, conn.max_attempts, conn.compression, conn.transfer) == (
        ["http://a:8001", "http://b:8001"], "k", 12.5, 2, "zstd", "http")
    client = HsxClient.from_settings(conn)
    assert (client.servers, client.max_attempts, client.compression) == (conn.server, 2, "zstd")
