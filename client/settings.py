"""The client's connection defaults, in one place; each also an `HSX_*` environment variable.

`HsxClient`, `ExtractConfig` and the `hsx extract` flags take their defaults from here
(`DEFAULTS`, the values without the environment); the command line reads the
environment through `ClientSettings()` (pydantic-settings, as the server does), so a
flag > an environment variable > the default.

    HSX_SERVER (comma-separated URLs), HSX_API_KEY, HSX_CONCURRENCY_PER_SERVER,
    HSX_TIMEOUT, HSX_MAX_ATTEMPTS, HSX_COMPRESSION, HSX_TRANSFER
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated

from hsx.host import usable_cores


# The choices of the connection, written once: the flags, the environment and HsxClient check them here.
Compression = Literal["auto", "zstd", "bf16split", "none"]  # the response body's compression (wire: Accept-Encoding / media type)
Transfer = Literal["auto", "http"]
COMPRESSIONS: tuple[str, ...] = get_args(Compression)
TRANSFERS: tuple[str, ...] = get_args(Transfer)


class ClientSettings(BaseSettings):
    """The connection to the servers, one object passed whole (HsxClient.from_settings, ExtractConfig.client,
    the worker processes' spec)."""

    model_config = SettingsConfigDict(env_prefix="HSX_", extra="ignore")

    server: Annotated[list[str], NoDecode] = Field(default_factory=list, description="hsx server base URLs")
    api_key: str | None = Field(None, description="Bearer token")
    concurrency_per_server: int = Field(8, ge=1, description="requests in flight per server")
    timeout: float = Field(600.0, gt=0, description="seconds per request")
    max_attempts: int = Field(10, ge=1, description="attempts per request before giving up")
    compression: Compression = Field(
        "auto", description="response compression: auto = none from local servers, zstd from others"
    )
    transfer: Transfer = Field(
        "auto", description="auto = same-host servers hand over the states in shared memory (leases)"
    )
    unhealthy_cooldown: float = Field(10.0, gt=0, description="seconds a failing server is set aside")

    @field_validator("server", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [u.strip() for u in value.split(",") if u.strip()]
        return value


    @classmethod
    def given(cls, server: list[str] | str, **values: object) -> ClientSettings:
        """These values over the defaults, validated, never the environment: the library's way
        (HsxClient's and ExtractConfig's defaults do not read HSX_*; the command line does)."""
        return _Given(server=server, **values)


class _Given(ClientSettings):
    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **sources):  # type: ignore[override]
        return (init_settings,)


DEFAULTS = ClientSettings.model_construct()  # the defaults alone, without the environment


MAX_DEFAULT_WORKERS = 16


def default_workers(cores: int | None = None) -> int:
    """`hsx extract --workers`' default: min(cores, 16), but 1 on <= 2 cores. There the
    server (often on the same host), the parent and the workers would fight for the same
    cores, and the in-process loop is the path every test measures. 16, not 8: on the
    16-core H200 host, beside the server, 16 workers received a zstd body in 0.28 s where
    8 took 0.64 s (8B shape, 2026-12-02: zstd 0.888x -> 0.919x of plain prefill, identity
    0.950x -> 0.968x; bench/README.md, fifth session)."""
    if cores is None:
        cores = usable_cores()
    return 1 if cores <= 2 else min(cores, MAX_DEFAULT_WORKERS)
