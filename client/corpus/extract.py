"""`hsx extract`: the crash-safe, resumable corpus writer, step by step.

 1. check --output (not a file, not under one, writable), lock DIR/.lock (one writer per
    output dir), remove temporary files a crash left;
 2. `GET /info` of every server (they must serve the same model and layers; a server that
    never answers is set aside at once, and when none answers the run stops within
    seconds), `/final_norm` when the format needs it;
 3. pre-flight, before any sample is sent: the layers the format needs (EAGLE-3: 3 aux + the
    last), `--layers` against the served ones, `--draft-vocab-size` within the vocab,
    `--max-length` within the servers' `max_tokens_per_request` (and its default: their
    smallest), a chat template for chat rows;
 4. read the samples (`hsx_client.corpus.inputs.read_samples`), fingerprint them; no usable row
    is a refusal that says why;
 5. the plan (hsx_client.corpus.plan): made on a new dir, the disk it needs checked, and only then
    saved (with bad_rows.jsonl); reused on an existing dir. A run refused before its plan
    leaves DIR as it was (no lock file, no directory it created);
 6. what is done and what is to do (hsx_client.corpus.plan), the disk it needs, refused when the
    disk cannot hold it;
 7. the fan-out loop (hsx_client.corpus.run; with --workers N over worker processes,
    hsx_client.corpus.workers): each response decoded, encoded by the format, its files stored
    atomically and only then its manifest line appended (fsync'ed) by this process;
 8. when every planned sample is done, failed or dropped: the format's finalize, then
    `hsx_corpus.json` (hsx_client.corpus.provenance), atomically.

Failed and dropped samples: see hsx_client.corpus.run; finalize leaves them out, and
`hsx_corpus.json` lists them. The summary counts them by reason. Ctrl-C (SIGINT/SIGTERM): stop admitting, cancel requests in
flight, let stores already running finish, exit 130. A second Ctrl-C exits at once; the
state is still consistent (a kill -9 is too: see hsx_client.corpus.store).

Exit codes: EXIT_CODES (printed by `hsx extract --help`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.exit_codes import ExitCode
from hsx.sizes import fmt_bytes
from hsx_client.corpus import plan as planning
from hsx_client.corpus import disk_estimate, journal, merged, store
from hsx_client.api import HsxClient
from hsx_client.errors import AuthenticationError, HsxError, RetriesExhaustedError, ServersUnreachableError
from hsx_client.corpus.plan import ConfigError
from hsx_client.corpus.preflight import (
    check_chat_template, check_states_for_images, preflight, servers_agree, token_ratio, wants_final_norm,
)
from hsx_client.corpus.progress import Progress, format_summary, reason_counts
from hsx_client.corpus.provenance import finalize
from hsx_client.corpus.settings import PLAN_KEYS, CorpusSettings
from hsx_client.corpus.run import RunLoop
from hsx_client.corpus.run_state import RunHooks, RunState
from hsx_client.settings import ClientSettings
from hsx_client.corpus.template_tools import tools_not_rendered
from hsx_client.corpus.verify import verify_corpus, verify_samples
from hsx_client.corpus.workers import WorkerPool, worker_count, worker_spec

# The one text of the exit codes: `hsx extract --help` prints it (cli.exit_codes_help).
EXIT_CODES = {
    ExitCode.OK: "complete: every planned sample stored, or dropped by policy (no supervised token "
             "after truncation: nothing to train on; counted in the summary)",
    ExitCode.FAILED: "run failed: stopped on an error (rerun the same command to resume), or finished "
                "with failed samples (the corpus holds the others; --retry-failed retries them)",
    ExitCode.REFUSED: "refused before any work: usage, no usable input rows, settings differ from the plan, "
                  "pre-flight against the servers' /info (layers, draft vocab, max length, chat "
                  "template), dir locked or not writable, disk too small, auth",
    ExitCode.INTERRUPTED: "interrupted (rerun the same command to resume)",
}


@dataclass
class ExtractConfig:
    client: ClientSettings  # the connection, servers included (defaults: hsx_client.settings)
    output: Path
    inputs: list[str] | None = None
    # The corpus settings (CorpusSettings' fields); None: not given (the plan's value, else the default).
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
    draft: str | None = None  # eagle3 | peagle | dflash | dspark | mtp | domino (client/corpus/drafts.py)
    # This run.
    resume: bool = False
    verify: bool = False
    retry_failed: bool = False
    force_disk: bool = False
    quiet: bool = False
    write_workers: int | None = None
    max_buffer_bytes: int | None = None  # the client's memory budget (None: hsx_client.byte_budget's default)
    workers: int = 1  # processes (hsx_client.corpus.workers); 1: the in-process loop (the CLI's default: the core count)
    handle_signals: bool = False
    shard: planning.ShardSpec | None = None  # --shard I/N: take slice I of the global plan


@dataclass
class Hooks:
    """The format/input side, injectable for tests."""

    read_samples: Callable[..., list[Any]]
    get_format: Callable[..., Any]  # (name, **formats.format_options(settings))
    make_context: Callable[..., Any]


def default_hooks() -> Hooks:
    from hsx_client.corpus import formats, inputs

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
        self.loop: RunLoop | WorkerPool | None = None
        self._stop_reason: str | None = None
        self._notes: list[str] = []  # said once the progress bar is up
        self._token_ratio: Any = None  # preflight.TokenCounts: the served tokenizer's counts of a sample
        self._disk_estimate: int | None = None
        self._tools_not_rendered = 0  # planned samples whose `tools` the chat template ignores
        self._merged = False  # DIR is a merged corpus, repaired in place (hsx_client.corpus.merged)

    def request_stop(self, reason: str) -> None:
        """Stop admitting samples and cancel the requests in flight (exit 130)."""
        if self.loop is not None:
            self.loop.request_stop(reason)
        else:
            self._stop_reason = reason

    async def run(self) -> ExtractResult:
        out = self.out
        try:
            store.check_output_dir(out)
            created, lock_existed = store.first_missing(out), (out / store.LOCK_NAME).exists()
            lock = journal.DirLock(out).acquire("hsx extract")
        except store.StoreError as exc:
            return ExtractResult(ExitCode.REFUSED, "refused", {"message": str(exc)})
        try:
            result = await self._run_locked()
        except (ConfigError, store.StoreError) as exc:
            result = ExtractResult(ExitCode.REFUSED, "refused", {"message": str(exc)})
        except AuthenticationError as exc:
            result = ExtractResult(ExitCode.REFUSED, "refused", {"message": f"authentication failed: {exc}"})
        except ServersUnreachableError as exc:
            result = ExtractResult(ExitCode.FAILED, "error", {"message": exc.message})
        except RetriesExhaustedError as exc:
            result = ExtractResult(ExitCode.FAILED, "error", {"message": f"servers unreachable: {exc}"})
        except HsxError as exc:
            result = ExtractResult(ExitCode.FAILED, "error", {"message": str(exc)})
        except OSError as exc:  # a full disk, a read-only remount mid-run: one line, resumable
            result = ExtractResult(ExitCode.FAILED, "error", {
                "message": f"{exc.strerror or exc}{': ' + exc.filename if exc.filename else ''} "
                           "(fix it, then rerun the same command to resume)"})
        if not (out / store.PLAN_NAME).exists():  # refused before its plan: leave DIR as it was
            store.remove_new_dir(out, created, lock_existed)
        lock.release()
        return result

    def _client(self) -> HsxClient:
        return HsxClient.from_settings(self.cfg.client, transport=self.transport)

    async def _run_locked(self) -> ExtractResult:
        cfg, out, hooks = self.cfg, self.out, self.hooks
        removed = store.clean_temp_files(out)
        plan = planning.load_plan(out)
        self._check_output(plan)
        settings, fmt, inputs = self._settings_format_inputs(plan)

        async with self._client() as client:
            info = await client.info()
            infos = await servers_agree(client, info, self._notes)
            settings.layers = planning.served_layers(settings.layers, info)
            if plan is None and settings.max_length is None:  # the servers' limit, recorded in the plan
                settings.max_length = planning.servers_max_tokens(infos.values())
            preflight(fmt, settings, info, infos)
            final_norm = await client.final_norm() if wants_final_norm(fmt, info) else None

            samples = planning.Samples.read(hooks.read_samples, inputs, settings.mask_policy)
            check_chat_template(samples, infos)
            check_states_for_images(fmt, samples)
            ctx = hooks.make_context(
                layer_ids=settings.layers,
                hidden_size=int(info["hidden_size"]),
                dtype=info["dtype"],
                final_norm=final_norm,
                draft_vocab_size=settings.draft_vocab_size,
                vocab_size=int(info["vocab_size"]) if info.get("vocab_size") is not None else None,
                mask_policy=settings.mask_policy,
            )
            try:  # what finalize needs, imported now: a missing package fails here, not after the run
                fmt.prepare()
            except ImportError as exc:
                raise ConfigError(str(exc)) from exc
            if cfg.quiet:
                _silence_progress_bars()
            disk = None
            if plan is None:  # every check passes before DIR gets its plan
                plan = planning.new_plan(settings, inputs, samples, info, shard=cfg.shard)
                self._token_ratio = await token_ratio(client, plan["keys"], samples, settings)
                disk = self._check_disk(list(range(len(plan["keys"]))), plan["keys"], samples, settings, info,
                                        fmt, ctx)
                store.write_files_atomic(out, {store.BAD_ROWS_NAME: b"".join(
                    (json.dumps(b) + "\n").encode() for b in samples.bad)}, _reserved_ok=True)
                store.write_json_atomic(out / store.PLAN_NAME, plan)
                new_run = True
            else:
                planning.check_resumable(plan, inputs, samples, info, settings.layers, out, shard=cfg.shard)
                new_run = False
            keys = plan["keys"]
            self._tools_not_rendered = await tools_not_rendered(
                client, (samples.by_key[k].request for k in keys), settings.max_length)
            if self._tools_not_rendered:
                self._notes.append(f"warning: {self._tools_not_rendered} sample(s) carry tool definitions that the "
                                   "server's chat template does not render (they are stored without them)")

            state, run_summary = await self._run_plan(client, fmt, ctx, settings, samples, info, keys,
                                                      new_run=new_run, disk=disk, removed=removed)
        return self._result(state, plan, info, final_norm, settings, run_summary)

    def _check_output(self, plan: dict[str, Any] | None) -> None:
        """DIR holds this run's plan, or nothing yet (a merged corpus: only repairs)."""
        cfg, out = self.cfg, self.out
        self._merged = merged.is_merged(plan)
        if self._merged:
            merged.check_repairable(out, cfg.retry_failed)
        if plan is None:
            if cfg.resume:
                raise ConfigError(f"--resume: {out} holds no plan.json (nothing to resume)")
            others = [p.name for p in out.iterdir() if p.name != store.LOCK_NAME]
            if others:
                raise ConfigError(
                    f"{out} is not empty and holds no hsx plan ({', '.join(sorted(others)[:5])}...); "
                    "pick an empty or new --output"
                )

    def _settings_format_inputs(self, plan: dict[str, Any] | None) -> tuple[CorpusSettings, Any, list[str]]:
        """The run's settings (the command's over the plan's), its format and its inputs."""
        cfg = self.cfg
        settings = CorpusSettings.resolve({k: getattr(cfg, k) for k in PLAN_KEYS}, plan, self.out)
        if settings.format is None:
            raise ConfigError("--format is required (speculators or specforge)")
        from hsx_client.corpus.formats import format_options

        try:
            fmt = self.hooks.get_format(settings.format, **format_options(settings))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        inputs = cfg.inputs if cfg.inputs else (plan["inputs"] if plan else None)
        if not inputs:
            raise ConfigError("--input is required")
        return settings, fmt, [planning.normalize_input(p) for p in inputs]

    async def _run_plan(self, client: HsxClient, fmt: Any, ctx: Any, settings: CorpusSettings, samples: Any,
                        info: dict[str, Any], keys: list[str], *, new_run: bool, disk: Any,
                        removed: int) -> tuple[RunState, dict[str, Any]]:
        """The samples not yet done fetched and stored, the manifest and failed log open."""
        cfg, out = self.cfg, self.out
        with journal.JsonlLog(out / store.MANIFEST_NAME) as manifest, \
                journal.JsonlLog(out / store.FAILED_NAME) as failed_log:
            done, failed, redo = self._what_is_done(fmt, keys, manifest)
            todo = planning.pending(len(keys), done, failed)
            if not new_run and todo:
                self._token_ratio = await token_ratio(client, [keys[i] for i in todo], samples, settings)
                disk = self._check_disk(todo, keys, samples, settings, info, fmt, ctx)
            progress = Progress(len(todo), quiet=cfg.quiet, server_stats=client.stats)
            for note in self._notes:
                progress.write(note)
            if removed:
                progress.write(f"removed {removed} temporary file(s) left by an earlier run")
            if redo:
                progress.write(f"{redo} stored sample(s) were missing or broken; redoing them")
            if disk is not None and not disk.ok:
                progress.write(
                    f"warning: need ~{fmt_bytes(disk.needed)}, {fmt_bytes(disk.free)} free (--force-disk)"
                )
            state = RunState(
                client=client, fmt=fmt, ctx=ctx, out=out, settings=settings,
                served_layers=[int(x) for x in info["layer_ids"]], keys=keys, by_key=samples.by_key,
                manifest=manifest, failed_log=failed_log, done=done, failed=failed, progress=progress,
                max_buffer_bytes=cfg.max_buffer_bytes,
            )
            self.loop = self._loop(state, client)
            if self._stop_reason is not None:
                self.loop.request_stop(self._stop_reason)
            try:
                await self.loop.run(todo)
            finally:
                progress.close()
            run_summary = progress.summary()
        return state, run_summary

    def _loop(self, state: RunState, client: HsxClient) -> RunLoop | WorkerPool:
        cfg = self.cfg
        workers = worker_count(cfg.workers, cfg.client.concurrency_per_server)
        if workers <= 1:
            return RunLoop(state, concurrency=cfg.client.concurrency_per_server * len(client.servers),
                           write_workers=cfg.write_workers, handle_signals=cfg.handle_signals, hooks=self.run_hooks)
        if self.transport is not None:
            raise ConfigError("workers > 1 need real connections (a test transport stays in this process)")
        spec = worker_spec(cfg, state, workers=workers, servers=list(client.servers))
        return WorkerPool(state, spec, workers=workers, handle_signals=cfg.handle_signals, hooks=self.run_hooks)

    def _what_is_done(self, fmt: Any, keys: list[str], manifest: journal.JsonlLog):
        """(done, failed for good, how many stored samples are redone)."""
        cfg, out = self.cfg, self.out
        done = journal.latest_by_index(manifest.entries)
        compacted = (out / store.COMPACTION_JOURNAL).exists()
        if compacted:
            planning.refuse_changes_after_compaction(out, cfg.retry_failed)
        # A renumbered corpus's bad samples are redone too: under their plan index (the
        # manifest's), from where finalize's journal moves them to their place again.
        redo = planning.invalidate_from_verify(out, manifest, done)
        if cfg.verify:
            bad = verify_samples(out, fmt, keys, done, quiet=cfg.quiet)
            redo += planning.invalidate(manifest, done, bad)
        redo += planning.drop_broken(out, keys, done, check_sizes=not compacted)
        failed = planning.failed_for_good(out, len(keys), done)
        if self._merged:  # the sample set is fixed: every repair that failed is retried
            failed = {}
        elif compacted:  # the failed set is fixed; a repair whose request failed on the way is retried
            repairs = planning.repairing(journal.read_jsonl(out / store.MANIFEST_NAME)[0], done)
            failed = {i: e for i, e in failed.items() if not (i in repairs and e.get("kind") in planning.RETRIED_KINDS)}
        else:
            failed = {i: e for i, e in failed.items()
                      if not ((cfg.retry_failed and e.get("kind") != planning.DROPPED)
                              or e.get("kind") in planning.RETRIED_KINDS)}
        return done, failed, redo

    def _check_disk(self, todo: list[int], keys: list[str], samples: planning.Samples, settings: CorpusSettings,
                    info: dict[str, Any], fmt: Any, ctx: Any) -> disk_estimate.DiskEstimate | None:
        if not todo:
            return None
        corpus = self.out / store.CORPUS_NAME
        if self._merged:  # the corpus changes: no longer finished, the merge's record kept aside
            merged.set_aside(self.out)
        elif corpus.exists():  # the corpus changes: it is no longer finished
            corpus.unlink()
            store.fsync_dir(self.out)
        counts = self._token_ratio
        need = disk_estimate.disk_needed((samples.by_key[keys[i]].request for i in todo), fmt.bytes_per_token(ctx),
                                    settings.max_length, info.get("max_model_len"),
                                    counts.ratio if counts else 1.0, counts.kept if counts else 1.0,
                                    fmt.bytes_per_request)
        est = disk_estimate.check_disk_space(self.out, need, force=self.cfg.force_disk)
        self._disk_estimate = need
        return est

    def _result(self, state: RunState, plan: dict[str, Any], info: dict[str, Any], final_norm: Any,
                settings: CorpusSettings, run_summary: dict[str, Any]) -> ExtractResult:
        out, done, n = self.out, state.done, len(plan["keys"])
        not_stored = planning.failed_for_good(out, n, done)
        failed, dropped = planning.split_dropped(not_stored)
        remaining = n - len(done) - len(not_stored)
        bad_rows_file = out / store.BAD_ROWS_NAME
        bad_examples, _, _ = journal.read_jsonl(bad_rows_file)
        summary = {
            "output": str(out), "planned": n, "done": len(done), "failed": len(failed), "dropped": len(dropped),
            "remaining": remaining, "max_length": settings.max_length, "truncation": settings.truncation,
            "truncated": sum(1 for e in done.values() if e.get("truncated_from")),
            "failed_reasons": reason_counts(failed.values()), "dropped_reasons": reason_counts(dropped.values()),
            "bad_rows": plan.get("bad_rows", 0), "bad_row_kinds": plan.get("bad_row_kinds", {}),
            "bad_rows_file": str(bad_rows_file), "bad_row_examples": bad_examples[:5],
            "disk_estimate_bytes": self._disk_estimate, "tools_not_rendered": self._tools_not_rendered,
            "token_counts": vars(self._token_ratio) if self._token_ratio else None, **run_summary,
        }
        if state.fatal is not None:
            summary.update(status="error", message=f"stopped: {state.fatal} (rerun the same command to resume)")
            return ExtractResult(ExitCode.FAILED, "error", summary)
        if state.stopping:
            summary.update(status="interrupted", message="interrupted; rerun the same command to resume")
            return ExtractResult(ExitCode.INTERRUPTED, "interrupted", summary)
        if remaining:
            summary.update(status="error", message=f"{remaining} sample(s) not done; rerun to resume")
            return ExtractResult(ExitCode.FAILED, "error", summary)
        if not done:
            summary.update(status="error", message=f"no sample could be stored ({len(failed)} failed, {len(dropped)} "
                                                   f"dropped: reasons above; each is in {out / store.FAILED_NAME})")
            return ExtractResult(ExitCode.FAILED, "error", summary)
        if (out / store.CORPUS_NAME).exists():  # finished earlier; nothing changed
            corpus = json.loads((out / store.CORPUS_NAME).read_text())
            summary.update(status="complete", corpus=str(out / store.CORPUS_NAME),
                           tokens=corpus.get("counts", {}).get("tokens"), message="already complete")
        else:
            t = time.monotonic()
            try:
                corpus = (merged.finish(out, state.fmt, state.ctx, n, done, not_stored) if self._merged else
                          finalize(out, state.fmt, state.ctx, plan, done, not_stored, info, final_norm, settings))
            except OSError as exc:  # e.g. the disk filled up while writing the table
                summary.update(status="error", message=(
                    f"finalize failed: {exc.strerror or exc}{': ' + exc.filename if exc.filename else ''}; "
                    "every stored sample is kept: fix it, then rerun the same command to finish"))
                return ExtractResult(ExitCode.FAILED, "error", summary)
            except ValueError as exc:  # the format's CorpusFormatError: e.g. a repair that changed the sample set
                summary.update(status="error", message=(
                    f"finalize failed: {exc}; every stored sample is kept (see {out / store.FAILED_NAME} for samples "
                    "that failed), rerun the same command to retry"))
                return ExtractResult(ExitCode.FAILED, "error", summary)
            summary.update(status="complete", corpus=str(out / store.CORPUS_NAME),
                           tokens=corpus["counts"]["tokens"], finalize_s=round(time.monotonic() - t, 3))
        if failed:  # a corpus, but smaller than planned: not a success
            summary.update(status="complete_with_failures", message=(
                f"the corpus holds {len(done)} of {n} planned samples; {len(failed)} failed (reasons above; each "
                f"in {out / store.FAILED_NAME}); fix the cause and rerun with --retry-failed to add them"))
            return ExtractResult(ExitCode.FAILED, "complete_with_failures", summary)
        return ExtractResult(ExitCode.OK, "complete", summary)


def _silence_progress_bars() -> None:
    """--quiet: datasets' own "Saving the dataset" bars too (finalize's save_to_disk; the
    format's `prepare` imported datasets already when its finalize uses it)."""
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def run_extract(cfg: ExtractConfig, hooks: Hooks | None = None, *, transport: Any = None,
                run_hooks: RunHooks | None = None) -> ExtractResult:
    """Synchronous entry (the CLI's); from async code use `await Extractor(cfg).run()`."""
    return asyncio.run(Extractor(cfg, hooks, transport=transport, run_hooks=run_hooks).run())


__all__ = [
    "EXIT_CODES", "ConfigError", "ExtractConfig", "ExtractResult",
    "Extractor", "Hooks", "default_hooks", "format_summary", "run_extract", "verify_corpus",
]
