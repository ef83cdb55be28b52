"""`hsx serve MODEL [vLLM engine flags] [hsx flags]`.

vLLM's engine flags are parsed by vLLM's own parser (so every flag of the
installed version works unchanged); hsx's flags come from ServiceSettings, each
also an HSX_* variable. `HSX_ENGINE_ARGS` holds extra engine flags for
deployments that configure through the environment (command-line flags win).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import sys
import time

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
    except StartupError as exc:
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # pydantic validation of HSX_* / flags
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from hsx_service.app import ServerState, create_app
    from hsx_service.engine import Extractor

    extractor = Extractor(settings, engine_args)
    try:
        extractor.prepare()
    except StartupError as exc:
        extractor.shutdown()
        print(f"hsx serve: error: {exc}", file=sys.stderr)
        return 2
    state = ServerState(settings=settings, extractor=extractor)
    app = create_app(state)
    return run_server(app, state, settings)


def run_server(app, state, settings: ServiceSettings) -> int:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT: /ready and new requests answer 503 at once, in-flight ones
        get up to --shutdown-timeout, then the server stops and the process exits 0.
        A second SIGINT stops at once. Engine death exits 1."""

        exit_code = 0
        _loop: asyncio.AbstractEventLoop | None = None
        _draining = False

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            if self._draining or self._loop is None:
                if sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            self._draining = True
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

        async def _drain(self):
            service = state.service
            logging.getLogger("hsx").info("draining: up to %.0fs for in-flight requests", settings.shutdown_timeout)
            if service is not None:
                service.draining = True
                deadline = time.monotonic() + settings.shutdown_timeout
                # Leases count too: a same-host client still reading its states would
                # otherwise see the server go before its release, and redo the sample.
                def busy() -> int:
                    return service.inflight + (len(service.leases) if service.leases is not None else 0)

                while busy() > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if busy():
                    logging.getLogger("hsx").warning("drain timeout: %d requests or leases cut off", busy())
            self.should_exit = True

        def fail(self, reason: str) -> None:
            logging.getLogger("hsx").error("%s", reason)
            self.exit_code = 1
            self.should_exit = True

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)),
        timeout_keep_alive=30,
    )
    server = DrainingServer(config)
    state.on_engine_dead = lambda: server.fail("engine died")
    state.on_startup_failed = server.fail
    server.run()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
