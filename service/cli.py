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

from hsx_service.errors import StartupError
from hsx_service.settings import FLAG_NAMES, ServiceSettings, env_name


def _vllm_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from hsx_service.vllm_compat import flexible_parser

    parser = flexible_parser()(
        prog="hsx serve",
        description="Serve a model's hidden states over HTTP (POST /hidden_states). "
        "Takes vLLM's engine flags unchanged plus the hsx flags below (each also an HSX_* variable).",
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
        if field.annotation is bool:  # `--flag` alone means true; `--flag false` still works
            group.add_argument(flag, dest=f"hsx_{name}", default=None, nargs="?", const="true", help=help_)
        else:
            group.add_argument(flag, dest=f"hsx_{name}", default=None, help=help_)


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
    if model:
        args.model = model
    settings = ServiceSettings(model=args.model, **overrides)
    engine_args = engine_args_cls.from_cli_args(args)
    return settings, engine_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings, engine_args = parse(argv)
    except (StartupError, ValueError) as exc:  # ValueError: pydantic's check of HSX_* / flags
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from hsx_service.lifecycle import serve

    return serve(settings, engine_args)


if __name__ == "__main__":
    sys.exit(main())
