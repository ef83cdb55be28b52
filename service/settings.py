"""The service's own settings: every flag is also an `HSX_*` environment variable.

vLLM's engine flags are not here: `hsx serve` hands them to vLLM's own parser
unchanged (see cli.py). Precedence: command-line flag > environment > default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated

from hsx.layers import DRAFT_LAYER_SETS
from hsx.sizes import format_bytes, parse_bytes

GiB = 1 << 30
MiB = 1 << 20


def _int_list(value: object) -> object:
    if isinstance(value, str):
        value = value.strip()
        if not value:
            return None
        return [int(x) for x in value.replace(" ", "").split(",") if x]
    return value


def _byte_size(value: object) -> object:
    """`4GiB`, `512MiB`, `800MB` (hsx.sizes, as the client's --max-buffer-bytes) or a plain count."""
    if isinstance(value, str) and value.strip() and not value.strip().isdigit():
        return parse_bytes(value)
    return value


def _str_list(value: object) -> object:
    if isinstance(value, str):
        return [x.strip() for x in value.split(",") if x.strip()]
    return value


BYTE_FIELDS = ("max_body_bytes", "arena_bytes", "stream_window_bytes", "max_text_bytes", "tokenize_memory",
               "max_header_bytes", "max_image_bytes", "max_video_bytes")


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSX_", extra="ignore")

    model: str | None = Field(None, description="Model path or hub id (positional MODEL)")
    host: str = Field("0.0.0.0", description="Address to bind")
    port: int = Field(8001, ge=0, le=65535, description="Port to bind (vLLM's own server defaults to 8000)")
    layers: Annotated[list[int] | None, NoDecode] = Field(
        None, description="Layer ids to capture, e.g. 2,16,29,32 (default: 2, N//2, N-3, N, EAGLE-3's); "
        + DRAFT_LAYER_SETS
    )
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Accepted Bearer keys, comma-separated; none = no auth"
    )
    max_inflight: int = Field(256, ge=1, description="Requests admitted at once; more get 503")
    max_queued_tokens: int = Field(1 << 21, ge=1, description="Prompt tokens admitted at once; more get 503")
    max_body_bytes: int = Field(64 * MiB, ge=1024, description="Largest request body (413 beyond)")
    max_tokens_per_request: int | None = Field(
        None, ge=1, description="Largest prompt in tokens (413 beyond; default max_model_len - 1)"
    )
    max_messages: int = Field(4096, ge=1, description="Most chat messages in one request (413 beyond)")
    arena_bytes: int = Field(
        4 * GiB, ge=MiB, description="Shared-memory arena for states not yet sent (bounds unsent bytes)"
    )
    stream_window_bytes: int | None = Field(
        None, ge=64 * 1024,
        description="Arena bytes one request's states may hold at once; larger samples are copied and sent in "
        "token chunks through this window (default min(arena/8, 256 MiB))",
    )
    shm_dir: str = Field("/dev/shm", description="Directory of the shared-memory arena (a tmpfs)")
    shm_lease: bool = Field(
        True,
        description="Let same-host clients read the states from the arena (a lease) instead of an HTTP body",
    )
    lease_timeout: float = Field(
        120.0, gt=0, description="Seconds a same-host client may hold a lease before its range is reused"
    )
    lease_max_per_session: int = Field(
        64, ge=1,
        description="Same-host leases one client session may hold at once; beyond, HTTP bodies (client leases "
        "together hold at most half the arena)",
    )
    shutdown_timeout: float = Field(30.0, ge=0, description="Seconds in-flight requests get after SIGTERM")
    request_timeout: float = Field(600.0, gt=0, description="Seconds one request may take in the engine")
    chat_template: str | None = Field(None, description="Jinja chat template file (default: the tokenizer's)")
    trust_request_chat_template: bool = Field(
        False, description="Accept a chat_template in requests (off: 400; a template is code the server runs)"
    )
    max_text_bytes: int | None = Field(
        None, ge=1, description="Most text bytes in one request, on every route that takes text (413 beyond; "
        "default 64 x the token limit, at least 4 MiB)"
    )
    tokenize_workers: int = Field(2, ge=1, description="Processes that render chat templates and tokenize")
    template_workers: int = Field(
        1, ge=1, description="Processes that render request-supplied chat templates (with "
        "--trust-request-chat-template), apart from those of the server's own template and prompts",
    )
    tokenize_queue: int = Field(
        32, ge=0, description="Requests waiting for a tokenizer process beyond the busy ones (503 beyond; the last "
        "--tokenize-workers places are kept for clients with none there)")
    tokenize_timeout: float = Field(30.0, gt=0, description="Seconds one request may spend templating and tokenizing (400 beyond)")
    tokenize_memory: int = Field(
        4 * GiB, ge=256 * MiB, description="Bytes each tokenizer process may allocate beyond its loaded tokenizer (a request that needs more: 413)"
    )
    body_timeout: float = Field(30.0, gt=0, description="Seconds a client may take to send its request body (408 beyond)")
    max_receiving: int = Field(64, ge=1, description="Connections still sending their request body at once (503 beyond)")
    header_timeout: float = Field(
        20.0, gt=0, description="Seconds a connection may take to send a request's headers (then it is closed)"
    )
    max_connections: int = Field(
        4096, ge=16,
        description="Open connections per serving process; beyond, the longest-idle one is closed, else the new one "
        "(a few more are kept for the probes)",
    )
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="Largest total size of a request's headers (431 beyond)")
    max_headers: int = Field(100, ge=8, description="Most headers in one request (431 beyond)")
    lease_api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="API keys that may take same-host leases (read the shared arena); with --api-key set, others get HTTP bodies",
    )
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level of compressed responses")
    compress_threads: int | None = Field(
        None, ge=1, description="Threads compressing response bodies (default: the cores less 2, at least 1)"
    )
    zstd_frame_threads: int | None = Field(
        None, ge=0, le=32,
        description="zstd threads per compressed body (still one frame; 0: single-threaded): one body's compression "
        "spread over cores, for a run's last bodies (default: 2 on hosts with >= 8 cores, else 0; measured on a "
        "16-core H200 host and the 2-core CI box)",
    )
    compress_inflight: int = Field(
        64, ge=1, description="4 MiB pieces being compressed at once, all bodies together (bounds that memory)"
    )
    http_workers: int | None = Field(
        None, ge=0, le=64,
        description="Processes that serve HTTP and send the bodies from the shared arena, beside the engine's "
        "(0: the engine process serves HTTP itself; default: 0 on vLLM's CPU backend, else a quarter of the "
        "cores, 2 to 8)",
    )
    max_images_per_request: int = Field(8, ge=0, description="Most image parts in one request (413 beyond)")
    max_image_bytes: int = Field(20 * MiB, ge=1024, description="Largest encoded image (data URI, file or download; 413 beyond)")
    max_image_pixels: int = Field(
        40_000_000, ge=1, description="Most pixels (width x height) in one image, read from its header before "
        "decoding (413 beyond)")
    max_videos_per_request: int = Field(1, ge=0, description="Most video parts in one request, for a model that "
                                        "takes video (413 beyond)")
    max_video_bytes: int = Field(64 * MiB, ge=1024, description="Largest encoded video (data URI, file or download; "
                                 "413 beyond)")
    max_video_frames: int = Field(
        32, ge=1, description="Most frames in one video, read from its header before decoding (413 beyond: sample "
        "the video before sending it)")
    max_video_pixels: int = Field(
        100_000_000, ge=1, description="Most pixels in one video, all its frames together (frames x width x height, "
        "from its header before decoding; each frame also within --max-image-pixels; 413 beyond)")
    allowed_media_dir: str | None = Field(
        None, description="Directory whose files requests may name as images or videos (a path or file:// URL; nothing "
        "outside it once symlinks are resolved; default: local paths refused)")
    allow_remote_media: bool = Field(
        False, description="Fetch http(s) image and video URLs named in requests (off: 400; on, clients make the server "
        "fetch URLs: docs/security.md)")
    remote_media_timeout: float = Field(10.0, gt=0, description="Seconds one image or video download may take (with --allow-remote-media)")
    log_level: str = Field("info", description="Log level (debug, info, warning, error)")
    allow_unverified_hybrid: bool = Field(
        False,
        description="Serve a hybrid (Mamba / linear-attention) model on a vLLM release or backend where hsx has "
        "not compared its states with transformers (docs/compatibility.md)",
    )

    @property
    def accepted_keys(self) -> list[str]:
        """Every key that may call the API: --api-key and --lease-api-key."""
        return list(dict.fromkeys([*self.api_key, *self.lease_api_key]))

    @field_validator("allowed_media_dir")
    @classmethod
    def _media_dir_exists(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isdir(value):
            raise ValueError("not a directory")
        return value

    _split_layers = field_validator("layers", mode="before")(_int_list)
    _split_keys = field_validator("api_key", "lease_api_key", mode="before")(_str_list)
    _sizes = field_validator(*BYTE_FIELDS, mode="before")(_byte_size)


# The service's flags: name -> help, for cli.py and for the deployment tests.
FLAG_NAMES = [name for name in ServiceSettings.model_fields if name != "model"]


def env_name(field: str) -> str:
    return "HSX_" + field.upper()


_BOUNDS = (("ge", "at least"), ("gt", "more than"), ("le", "at most"), ("lt", "less than"))


def refusal_line(exc: ValidationError, flags: Mapping[str, object]) -> str:
    """pydantic's report of bad settings as one line: each setting by the flag or HSX_*
    variable it came from (`flags`: the values given as flags, by name), the value as
    written there, and why."""
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err.get("loc") else "?"
        if name in flags:
            where = f"--{name.replace('_', '-')} {flags[name]}"
        else:
            where = f"{env_name(name)}={os.environ.get(env_name(name), err.get('input'))}"
        ctx = err.get("ctx") or {}
        bound = next(((word, ctx[k]) for k, word in _BOUNDS if k in ctx), None)
        if bound is not None:
            limit = bound[1]
            why = f"must be {bound[0]} " + (f"{format_bytes(limit)} ({limit} bytes)" if name in BYTE_FIELDS else str(limit))
        else:
            why = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {why}")
    return "; ".join(parts)
