"""`hsx extract`: the crash-safe, resumable corpus writer, step by step.

 1. lock DIR/.lock (one writer per output dir), remove temporary files a crash left;
 2. `GET /info` and `/final_norm` (every server must serve the same model and layers);
 3. read the samples (`hsx_client.inputs.read_samples`), fingerprint them;
 4. the plan (hsx_client.plan): made and saved on a new dir, reused on an existing one;
 5. what is done and what is to do (hsx_client.plan), the disk it needs, refused when the
    disk cannot hold it;
 6. the fan-out loop (hsx_client.run): each response decoded, encoded by the format, its
    files stored atomically and only then its manifest line appended (fsync'ed);
 7. when every planned sample is done or failed: the format's finalize, then
    `hsx_corpus.json` (hsx_client.provenance), atomically.

Failed samples: see hsx_client.run; they count as "failed" for finalize, and
`hsx_corpus.json` lists them. Ctrl-C (SIGINT/SIGTERM): stop admitting, cancel requests in
flight, let stores already running finish, exit 130. A second Ctrl-C exits at once; the
state is still consistent (a kill -9 is too: see hsx_client.store).

Exit codes: 0 complete, 1 stopped on an error (resumable), 2 refused (usage, settings,
lock, disk, auth), 130 interrupted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import plan as planning
from . import store
from .api import HsxClient
from .errors import AuthenticationError, HsxError, RetriesExhaustedError
from .plan import ConfigError
from .progress import Progress, format_summary
from .provenance import finalize
from .run import EXIT_INTERRUPTED, RunHooks, RunLoop, RunState
from .settings import DEFAULTS
from .verify import verify_corpus, verify_samples

EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2


@dataclass
class ExtractConfig:
    servers: list[str]
    output: Path
    inputs: list[str] | None = None
    # The corpus settings (plan.PLAN_KEYS); None: not given (the plan's value, else the default).
    format: str | None = None
    mask_policy: str | None = None
    max_length: int | None = None
    truncation: str | None = None
    layers: list[int] | None = None
    draft_vocab_size: int | None = None
    seed: int | None = None
    shuffle: bool | None = None
    max_samples: int | None = None
    states: str | None = None  # all | none (speculators' token table only)
    dtype: str | None = None  # auto | fp8
    # The connection (defaults: hsx_client.settings).
    concurrency_per_server: int = DEFAULTS.concurrency_per_server
    compression: str = DEFAULTS.compression  # auto: zstd from remote servers only (see HsxClient)
    transfer: str = DEFAULTS.transfer  # auto: same-host servers' states read from shared memory (leases)
    api_key: str | None = DEFAULTS.api_key
    timeout: float = DEFAULTS.timeout
    max_attempts: int = DEFAULTS.max_attempts
    unhealthy_cooldown: float = DEFAULTS.unhealthy_cooldown
    # This run.
    resume: bool = False
    verify: bool = False
    retry_failed: bool = False
    force_disk: bool = False
    quiet: bool = False
    write_workers: int | None = None
    handle_signals: bool = False
    shard: planning.ShardSpec | None = None  # --shard I/N: take slice I of the global plan


@dataclass
class Hooks:
    """The format/input side, injectable for tests."""

    read_samples: Callable[..., list[Any]]
    get_format: Callable[..., Any]  # (name, **formats.format_options(settings))
    make_context: Callable[..., Any]


def default_hooks() -> Hooks:
    from . import formats, inputs

    return Hooks(read_samples=inputs.read_samples, get_format=formats.get_format, make_context=formats.CorpusContext)


@dataclass
class ExtractResult:
    exit_code: int
    status: str  # complete | interrupted | error | refused
    summary: dict[str, Any] = field(default_factory=dict)


class Extractor:
    def __init__(self, cfg: ExtractConfig, hooks: Hooks | None = None, *, transport: Any = None,
                 run_hooks: RunHooks | None = None) -> None:
        self.cfg = cfg
        self.hooks = hooks or default_hooks()
        self.out = Path(cfg.output)
        self.transport = transport  # httpx transport, for tests
        self.run_hooks = run_hooks
        self.loop: RunLoop | None = None
        self._stop_reason: str | None = None

    def request_stop(self, reason: str) -> None:
        """Stop admitting samples and cancel the requests in flight (exit 130)."""
        if self.loop is not None:
            self.loop.request_stop(reason)
        else:
            self._stop_reason = reason

    async def run(self) -> ExtractResult:
        try:
            lock = store.DirLock(self.out).acquire("hsx extract")
        except store.StoreError as exc:
            return ExtractResult(EXIT_REFUSED, "refused", {"message": str(exc)})
        try:
            return await self._run_locked()
        except (ConfigError, store.StoreError) as exc:
            return ExtractResult(EXIT_REFUSED, "refused", {"message": str(exc)})
        except AuthenticationError as exc:
            return ExtractResult(EXIT_REFUSED, "refused", {"message": f"authentication failed: {exc}"})
        except RetriesExhaustedError as exc:
            return ExtractResult(EXIT_ERROR, "error", {"message": f"servers unreachable: {exc}"})
        except HsxError as exc:
            return ExtractResult(EXIT_ERROR, "error", {"message": str(exc)})
        finally:
            lock.release()

    def _client(self) -> HsxClient:
        cfg = self.cfg
        return HsxClient(
            cfg.servers, api_key=cfg.api_key, concurrency_per_server=cfg.concurrency_per_server,
            timeout=cfg.timeout, max_attempts=cfg.max_attempts, unhealthy_cooldown=cfg.unhealthy_cooldown,
            transport=self.transport, compression=cfg.compression, transfer=cfg.transfer,
        )

    async def _run_locked(self) -> ExtractResult:
        cfg, out, hooks = self.cfg, self.out, self.hooks
        removed = store.clean_temp_files(out)
        plan = planning.load_plan(out)
        if plan is None:
            if cfg.resume:
                raise ConfigError(f"--resume: {out} holds no plan.json (nothing to resume)")
            others = [p.name for p in out.iterdir() if p.name != store.LOCK_NAME]
            if others:
                raise ConfigError(
                    f"{out} is not empty and holds no hsx plan ({', '.join(sorted(others)[:5])}...); "
                    "pick an empty or new --output"
                )
        settings = planning.resolve_settings({k: getattr(cfg, k) for k in planning.PLAN_KEYS}, plan, out)
        if settings["format"] is None:
            raise ConfigError("--format is required (speculators or specforge)")
        from .formats import format_options

        try:
            fmt = hooks.get_format(settings["format"], **format_options(settings))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        inputs = cfg.inputs if cfg.inputs else (plan["inputs"] if plan else None)
        if not inputs:
            raise ConfigError("--input is required")
        inputs = [planning.normalize_input(p) for p in inputs]

        async with self._client() as client:
            info = await client.info()
            await self._check_servers_agree(client, info)
            final_norm = await client.final_norm()
            settings["layers"] = planning.served_layers(settings["layers"], info)

            samples = planning.Samples.read(hooks.read_samples, inputs, settings["mask_policy"])
            if plan is None:
                plan = planning.new_plan(settings, inputs, samples, info, shard=cfg.shard)
                store.write_json_atomic(out / store.PLAN_NAME, plan)
            else:
                planning.check_resumable(plan, inputs, samples, info, settings["layers"], out, shard=cfg.shard)
            keys = plan["keys"]
            ctx = hooks.make_context(
                layer_ids=settings["layers"],
                hidden_size=int(info["hidden_size"]),
                dtype=info["dtype"],
                final_norm=final_norm,
                draft_vocab_size=settings["draft_vocab_size"],
                vocab_size=int(info["vocab_size"]) if info.get("vocab_size") is not None else None,
                mask_policy=settings["mask_policy"],
            )
            try:  # what finalize needs, imported now: a missing package fails here, not after the run
                getattr(fmt, "prepare", lambda: None)()
            except ImportError as exc:
                raise ConfigError(str(exc)) from exc

            with store.JsonlLog(out / store.MANIFEST_NAME) as manifest, \
                    store.JsonlLog(out / store.FAILED_NAME) as failed_log:
                done, failed, redo = self._what_is_done(fmt, keys, manifest)
                todo = planning.pending(len(keys), done, failed)
                disk = self._check_disk(todo, keys, samples, settings, info, fmt, ctx)
                progress = Progress(len(keys), initial=len(keys) - len(todo), quiet=cfg.quiet,
                                    server_stats=client.stats)
                if removed:
                    progress.write(f"removed {removed} temporary file(s) left by an earlier run")
                if redo:
                    progress.write(f"{redo} stored sample(s) were missing or broken; redoing them")
                if disk is not None and not disk.ok:
                    progress.write(
                        f"warning: need ~{store.fmt_bytes(disk.needed)}, {store.fmt_bytes(disk.free)} free (--force-disk)"
                    )
                state = RunState(
                    client=client, fmt=fmt, ctx=ctx, out=out, settings=settings,
                    served_layers=[int(x) for x in info["layer_ids"]], keys=keys, by_key=samples.by_key,
                    manifest=manifest, failed_log=failed_log, done=done, failed=failed, progress=progress,
                )
                self.loop = RunLoop(state, concurrency=cfg.concurrency_per_server * len(client.servers),
                                    write_workers=cfg.write_workers, handle_signals=cfg.handle_signals,
                                    hooks=self.run_hooks)
                if self._stop_reason is not None:
                    self.loop.request_stop(self._stop_reason)
                try:
                    await self.loop.run(todo)
                finally:
                    progress.close()
                run_summary = progress.summary()
        return self._result(state, plan, info, final_norm, settings, run_summary)

    def _what_is_done(self, fmt: Any, keys: list[str], manifest: store.JsonlLog):
        """(done, failed for good, how many stored samples are redone)."""
        cfg, out = self.cfg, self.out
        done = store.latest_by_index(manifest.entries)
        compacted = (out / store.COMPACTION_JOURNAL).exists()
        if compacted:
            planning.refuse_changes_after_compaction(out, cfg.verify, cfg.retry_failed)
        redo = 0 if compacted else planning.invalidate_from_verify(out, manifest, done)
        if cfg.verify:
            bad = verify_samples(out, fmt, keys, done, quiet=cfg.quiet)
            redo += planning.invalidate(manifest, done, bad)
        redo += planning.drop_broken(out, keys, done, check_sizes=not compacted)
        failed = planning.failed_for_good(out, len(keys), done)
        if not compacted:
            failed = {i: e for i, e in failed.items()
                      if not (cfg.retry_failed or e.get("kind") in planning.RETRIED_KINDS)}
        return done, failed, redo

    def _check_disk(self, todo: list[int], keys: list[str], samples: planning.Samples, settings: dict[str, Any],
                    info: dict[str, Any], fmt: Any, ctx: Any) -> store.DiskEstimate | None:
        if not todo:
            return None
        corpus = self.out / store.CORPUS_NAME
        if corpus.exists():  # the corpus changes: it is no longer finished
            corpus.unlink()
            store.fsync_dir(self.out)
        need = planning.disk_needed((samples.by_key[keys[i]].request for i in todo), fmt.bytes_per_token(ctx),
                                    settings["max_length"], info.get("max_model_len"))
        return store.check_disk_space(self.out, need, force=self.cfg.force_disk)

    def _result(self, state: RunState, plan: dict[str, Any], info: dict[str, Any], final_norm: Any,
                settings: dict[str, Any], run_summary: dict[str, Any]) -> ExtractResult:
        out, done, n = self.out, state.done, len(plan["keys"])
        failed = planning.failed_for_good(out, n, done)
        remaining = n - len(done) - len(failed)
        summary = {
            "output": str(out), "planned": n, "done": len(done), "failed": len(failed), "remaining": remaining,
            "bad_rows": plan.get("bad_rows", 0), **run_summary,
        }
        if state.fatal is not None:
            summary.update(status="error", message=f"stopped: {state.fatal} (rerun the same command to resume)")
            return ExtractResult(EXIT_ERROR, "error", summary)
        if state.stopping:
            summary.update(status="interrupted", message="interrupted; rerun the same command to resume")
            return ExtractResult(EXIT_INTERRUPTED, "interrupted", summary)
        if remaining:
            summary.update(status="error", message=f"{remaining} sample(s) not done; rerun to resume")
            return ExtractResult(EXIT_ERROR, "error", summary)
        if not done:
            summary.update(status="error", message=f"no sample could be extracted; see {out / store.FAILED_NAME}")
            return ExtractResult(EXIT_ERROR, "error", summary)
        if (out / store.CORPUS_NAME).exists():  # finished earlier; nothing changed
            corpus = json.loads((out / store.CORPUS_NAME).read_text())
            summary.update(status="complete", corpus=str(out / store.CORPUS_NAME),
                           tokens=corpus.get("counts", {}).get("tokens"), message="already complete")
            return ExtractResult(EXIT_OK, "complete", summary)
        t = time.monotonic()
        corpus = finalize(out, state.fmt, state.ctx, plan, done, failed, info, final_norm, settings)
        summary.update(status="complete", corpus=str(out / store.CORPUS_NAME), tokens=corpus["counts"]["tokens"],
                       finalize_s=round(time.monotonic() - t, 3))
        if failed:
            summary["message"] = f"{len(failed)} sample(s) failed; see {out / store.FAILED_NAME}"
        return ExtractResult(EXIT_OK, "complete", summary)

    async def _check_servers_agree(self, client: HsxClient, info: dict[str, Any]) -> None:
        if len(client.servers) < 2:
            return
        keys = ("model", "model_revision", "layer_ids", "hidden_size", "dtype")
        for url, other in (await client.server_infos()).items():  # a down server is the loop's business
            diffs = [k for k in keys if other.get(k) != info.get(k)]
            if diffs:
                raise ConfigError(
                    f"{url} serves something else than {client.servers[0]}: "
                    + ", ".join(f"{k}={other.get(k)!r} vs {info.get(k)!r}" for k in diffs)
                )


def run_extract(cfg: ExtractConfig, hooks: Hooks | None = None, *, transport: Any = None,
                run_hooks: RunHooks | None = None) -> ExtractResult:
    """Synchronous entry (the CLI's); from async code use `await Extractor(cfg).run()`."""
    return asyncio.run(Extractor(cfg, hooks, transport=transport, run_hooks=run_hooks).run())


__all__ = [
    "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REFUSED", "ConfigError", "ExtractConfig", "ExtractResult",
    "Extractor", "Hooks", "default_hooks", "format_summary", "run_extract", "verify_corpus",
]
