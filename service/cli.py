"""`hsx serve MODEL [vLLM engine flags] [hsx flags]`.

vLLM's engine flags are parsed by vLLM's own parser (so every flag of the
installed version works unchanged); hsx's flags come from ServiceSettings, each
also an HSX_* variable. `HSX_ENGINE_ARGS` holds extra engine flags for
deployments that configure through the environment (command-line flags win).
The server's life after parsing (start, drain, exit codes) is lifecycle.py's.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys

from pydantic import ValidationError

from hsx.exit_codes import ExitCode
from hsx_service.core.errors import StartupError
from hsx_service.settings import FLAG_NAMES, ServiceSettings, env_name, refusal_line


def _vllm_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from hsx_service.engine.vllm_compat import flexible_parser

    parser = flexible_parser()(
        prog="hsx serve",
        description="Serve a model's hidden states over HTTP (POST /hidden_states). "
        "Takes vLLM's engine flags unchanged plus hsx's own (each also an HSX_* variable): "
        "`--help=hsx` lists hsx's flags with descriptions, `--help=all` every flag, "
        "`--help=ModelConfig` (or any group below) one of vLLM's groups, `--help=WORD` the flags matching WORD.",
    )
    parser.add_argument("model_tag", nargs="?", default=None, help="model path or hub id (or HSX_MODEL)")
    parser = AsyncEngineArgs.add_cli_args(parser)
    return parser, AsyncEngineArgs


# Flags vLLM's engine parser may already define with the same meaning (e.g. vLLM
# 0.32 has --shutdown-timeout for its own drain and --log-level): one flag sets both.


def _has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    return any(flag == s for a in parser._actions for s in a.option_strings)


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hsx", "hsx service settings (flag > environment variable > default)")
    for name in FLAG_NAMES:
        field = ServiceSettings.model_fields[name]
        flag = "--" + name.replace("_", "-")
        default = field.default if field.default_factory is None else field.default_factory()
        help_ = f"{field.description} [env {env_name(name)}; default {default!r}]"
        if _has_flag(parser, flag):
            continue
        # SUPPRESS: a flag not given sets nothing (parse reads it with getattr(..., None)), and
        # vLLM's help formatter then adds no "(default: None)" after the default named above.
        if field.annotation is bool:  # `--flag` alone means true; `--flag false` still works
            group.add_argument(flag, dest=f"hsx_{name}", default=argparse.SUPPRESS, nargs="?", const="true",
                               help=help_)
        else:
            group.add_argument(flag, dest=f"hsx_{name}", default=argparse.SUPPRESS, help=help_)


def parse(argv: list[str]):
    parser, engine_args_cls = _vllm_parser()
    add_service_flags(parser)
    env_engine = shlex.split(os.environ.get("HSX_ENGINE_ARGS", ""))
    args = parser.parse_args(env_engine + list(argv))
    overrides = {n: v for n in FLAG_NAMES if (v := getattr(args, f"hsx_{n}", None)) is not None}
    for name in FLAG_NAMES:
        flag = "--" + name.replace("_", "-")
        given = [a for a in env_engine + list(argv) if a == flag or a.startswith(flag + "=")]
        if given and not hasattr(args, f"hsx_{name}"):
            overrides[name] = getattr(args, name)
    model = args.model_tag or os.environ.get("HSX_MODEL")
    if not model:  # vLLM would quietly serve (and download) its own default model
        raise StartupError("give the model to serve: hsx serve MODEL (a path or hub id), or set HSX_MODEL")
    args.model = model
    try:
        settings = ServiceSettings(model=args.model, **overrides)
    except ValidationError as exc:  # one line naming the flag or variable, not pydantic's report
        raise StartupError(refusal_line(exc, overrides)) from None
    engine_args = engine_args_cls.from_cli_args(args)
    return settings, engine_args


def early_address(argv: list[str]) -> tuple[str, int] | None:
    """--host / --port (flag > HSX_HOST / HSX_PORT > default) read without vLLM's parser;
    None where they do not parse here or help is asked for (`parse` then answers)."""
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        return None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--host")
    parser.add_argument("--port")
    try:
        known, _ = parser.parse_known_args(argv)
        host = known.host or os.environ.get(env_name("host")) or ServiceSettings.model_fields["host"].default
        port = int(known.port or os.environ.get(env_name("port")) or ServiceSettings.model_fields["port"].default)
    except (argparse.ArgumentError, ValueError):
        return None
    return (host, port) if 0 <= port <= 65535 else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    listener = None
    try:
        # The port first, before vLLM is imported: one in use is refused in a second.
        address = early_address(shlex.split(os.environ.get("HSX_ENGINE_ARGS", "")) + list(argv))
        if address is not None:
            from hsx_service.http.http_workers import Listener

            listener = Listener(*address)
        settings, engine_args = parse(argv)
    except (StartupError, ValueError) as exc:  # ValueError: pydantic's check of HSX_* / flags
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from hsx_service.lifecycle import serve

    cpu_kv_cache_default(argv + shlex.split(os.environ.get("HSX_ENGINE_ARGS", "")))
    return serve(settings, engine_args, listener)


KV_CACHE_FRACTION = 0.25  # of the memory free at start, for vLLM CPU's KV cache when nothing says
KV_CACHE_MAX_GIB = 8


def cpu_kv_cache_default(argv: list[str]) -> None:
    """vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB); unset, it
    may take more than the host has and the start fails far above the last log line.
    Unset and no --gpu-memory-utilization given: a quarter of the free memory (1..8 GiB),
    logged."""
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ or any(a.startswith("--gpu-memory-utilization") for a in argv):
        return
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import psutil

        free_gib = psutil.virtual_memory().available / (1 << 30)
    except Exception:  # no vLLM platform information: leave it to vLLM
        return
    gib = int(min(KV_CACHE_MAX_GIB, max(1, free_gib * KV_CACHE_FRACTION)))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
    logging.getLogger("hsx").info(
        "CPU backend: VLLM_CPU_KVCACHE_SPACE=%d (GiB of KV cache, a quarter of the %.1f GiB free); "
        "set it to choose", gib, free_gib)


if __name__ == "__main__":
    sys.exit(main())
