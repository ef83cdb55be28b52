"""`hsx extract` and `hsx verify`: the crash-safe, resumable corpus writer.

Run (`run_extract`):
 1. lock DIR/.lock (one writer per output dir), remove temp files a crash left;
 2. `GET /info` and `/final_norm` (every server must serve the same model and layers);
 3. read the samples (`hsx_client.inputs.read_samples`), fingerprint them;
 4. the plan: on a new dir, shuffle the sample keys with `--seed` (unless `--no-shuffle`),
    cut to `--max-samples`, and save `plan.json` (settings + keys by final index) before any
    extraction. On an existing dir the saved plan is reused as it is; a flag given with a
    value different from the plan's is refused, naming the setting; a flag left out takes
    the plan's value (so `hsx extract --resume --output DIR --server URL` is enough);
 5. what is done: the manifest (last line per index wins), minus samples whose files are
    missing or have another size than recorded, minus those `hsx verify` listed in
    `verify.json` (turned into manifest "invalid" lines, then the file removed), minus all
    that fail the full check when `--verify` is given;
 6. estimate the disk the remaining samples need and refuse when it is not free;
 7. fan the requests out over the servers; each response is decoded, encoded by the format,
    its files stored atomically and only then its manifest line appended (fsync'ed);
 8. when every planned sample is done or failed: `fmt.finalize(DIR, [(index, record)...])`,
    then `hsx_corpus.json` (provenance, counts, checksums of finalize's files), atomically.

Failures of one sample: 400/422/413 (and other 4xx) and a format that cannot encode the
response are permanent: logged to `failed.jsonl` and skipped, not retried on resume unless
`--retry-failed`. A sample on which every attempt got a 5xx (engine failure, bounded
retries) is logged as `server_error` and retried automatically by the next run. Both count
as "failed" for finalize. If the servers are unreachable beyond the retries, or many
samples in a row fail with 5xx, the run stops (exit 1) with a resumable state.

Finalize and failed samples: `finalize` receives only the done samples, `(index, record)`
sorted by index; a failed index is simply absent. What the format does with the gap
(compact the indices or keep them) is the format's business (see `hsx_client.formats`);
`hsx_corpus.json` lists the failed indices.

Ctrl-C (SIGINT/SIGTERM): stop admitting, cancel requests in flight (those samples are
simply not done), let stores already running finish, exit 130. A second Ctrl-C exits at
once; the state is still consistent (a kill -9 is too: see `hsx_client.store`).

Token estimate for the disk check: `input_ids` length, else characters / 3 of the prompt,
messages and tools (+8 per message), capped at `--max-length` and the server's
max_model_len. Characters / 3 over-counts typical English (~4 chars/token): on purpose.

Exit codes: 0 complete, 1 stopped on an error (resumable), 2 refused (usage, settings,
lock, disk, auth), 130 interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import store
from .errors import (
    AuthenticationError,
    HsxError,
    LeaseExpiredError,
    RetriesExhaustedError,
    ServerError,
)
from .progress import Progress, format_summary

log = logging.getLogger("hsx.extract")
_LEASE_REDOS = 3  # a sample whose lease expired this often before its store ended fails

PLAN_VERSION = 1
# Written by a format's finalize when it renumbers samples (speculators compacts failed
# indices away); maps manifest index -> final index. See hsx_client.formats.
COMPACTION_JOURNAL = "hsx_compaction.json"
EXIT_OK, EXIT_ERROR, EXIT_REFUSED, EXIT_INTERRUPTED = 0, 1, 2, 130

# Settings a plan fixes; the value None on the command line means "not given".
PLAN_KEYS = (
    "format",
    "mask_policy",
    "max_length",
    "truncation",
    "layers",
    "draft_vocab_size",
    "seed",
    "shuffle",
    "max_samples",
    "states",
    "dtype",
)
DEFAULTS: dict[str, Any] = {
    "format": None,
    "mask_policy": "per_turn",
    "max_length": None,
    "truncation": "right",
    "layers": None,
    "draft_vocab_size": None,
    "seed": 0,
    "shuffle": True,
    "max_samples": None,
    "states": "all",  # none: the token table only (online training, speculators_variants.py)
    "dtype": "auto",  # fp8: states stored as fp8 with per-token scales
}


class ConfigError(Exception):
    """The run cannot start as asked (exit 2)."""


class SampleEncodeError(Exception):
    """The format refused a response (recorded as a permanent failure)."""


@dataclass
class ExtractConfig:
    servers: list[str]
    output: Path
    inputs: list[str] | None = None
    format: str | None = None
    mask_policy: str | None = None
    max_length: int | None = None
    truncation: str | None = None
    layers: list[int] | None = None
    draft_vocab_size: int | None = None
    seed: int | None = None
    shuffle: bool | None = None
    max_samples: int | None = None
    states: str | None = None
    dtype: str | None = None
    concurrency_per_server: int = 8
    compression: str = "auto"  # auto: zstd from remote servers only (see HsxClient)
    transfer: str = "auto"  # auto: same-host servers' states read from shared memory (leases)
    api_key: str | None = None
    timeout: float = 600.0
    max_attempts: int = 10
    unhealthy_cooldown: float = 10.0
    resume: bool = False
    verify: bool = False
    retry_failed: bool = False
    force_disk: bool = False
    quiet: bool = False
    write_workers: int | None = None
    handle_signals: bool = False


@dataclass
class Hooks:
    """The format/input side, injectable for tests."""

    read_samples: Callable[..., list[Any]]
    get_format: Callable[[str], Any]
    make_context: Callable[..., Any]


def default_hooks() -> Hooks:
    from . import formats, inputs

    return Hooks(read_samples=inputs.read_samples, get_format=formats.get_format, make_context=formats.CorpusContext)


@dataclass
class ExtractResult:
    exit_code: int
    status: str  # complete | interrupted | error | refused
    summary: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- helpers
def inputs_fingerprint(samples: list[Any]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.key.encode())
        h.update(b"\0")
        h.update(json.dumps(s.request, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def estimate_tokens(request: dict[str, Any], max_length: int | None, max_model_len: int | None) -> int:
    if "input_ids" in request:
        n = len(request["input_ids"])
    else:
        chars = 0
        if isinstance(request.get("prompt"), str):
            chars += len(request["prompt"])
        for m in request.get("messages") or []:
            chars += 32  # role + template tokens, ~8 tokens a message
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                chars += len(c)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
            if isinstance(m, dict) and m.get("tool_calls"):
                chars += len(json.dumps(m["tool_calls"]))
        if request.get("tools"):
            chars += len(json.dumps(request["tools"]))
        n = chars // 3 + 1
    for cap in (max_length, max_model_len):
        if cap:
            n = min(n, int(cap))
    return n


def _norm_input(p: str) -> str:
    return os.path.abspath(p) if os.path.exists(p) else p


def load_plan(out: Path) -> dict[str, Any] | None:
    p = Path(out) / store.PLAN_NAME
    if not p.exists():
        return None
    with open(p) as f:
        plan = json.load(f)
    if plan.get("version") != PLAN_VERSION:
        raise ConfigError(f"{p} has plan version {plan.get('version')}, this client writes {PLAN_VERSION}")
    return plan


def load_failed(out: Path) -> dict[int, dict[str, Any]]:
    entries, _, _ = store.read_jsonl(Path(out) / store.FAILED_NAME)
    return {int(e["index"]): e for e in entries if "index" in e}


def _files_digest(out: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    res = {}
    for rel in rels:
        size, digest = store.hash_file(Path(out) / rel)
        res[rel] = {"size": size, store.HASH_ALGO: digest}
    return res


def _resolve_settings(cfg: ExtractConfig, plan: dict[str, Any] | None) -> dict[str, Any]:
    """Merge the command line with the plan (given flags must agree; missing ones come
    from the plan, else the defaults)."""
    given = {k: getattr(cfg, k) for k in PLAN_KEYS}
    if plan is None:
        return {k: (v if v is not None else DEFAULTS[k]) for k, v in given.items()}
    saved = plan["settings"]
    diffs = []
    for k, v in given.items():
        if v is not None and k in saved and saved[k] is not None and v != saved[k]:
            diffs.append(f"--{k.replace('_', '-')}: the plan has {saved[k]!r}, this run asks {v!r}")
        elif v is not None and k in saved and saved[k] is None and v != DEFAULTS[k]:
            diffs.append(f"--{k.replace('_', '-')}: the plan has none, this run asks {v!r}")
    if diffs:
        raise ConfigError(
            f"{cfg.output} holds a run made with other settings; resume with the same flags or use a "
            "new --output:\n  " + "\n  ".join(diffs)
        )
    return {k: saved.get(k, DEFAULTS[k]) for k in PLAN_KEYS}


# ---------------------------------------------------------------- the run
class Extractor:
    def __init__(self, cfg: ExtractConfig, hooks: Hooks | None = None, *, transport: Any = None) -> None:
        self.cfg = cfg
        self.hooks = hooks
        self.out = Path(cfg.output)
        self.transport = transport  # httpx transport, for tests
        self.stopping = False
        self.stop_reason: str | None = None
        self.fatal: BaseException | None = None
        self._phase: dict[asyncio.Task[Any], str] = {}
        self._sigints = 0
        self._consecutive_5xx = 0
        self._lease_redos: dict[int, int] = {}

    # -------------------------------------------------------------- control
    def request_stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopping = True
            self.stop_reason = reason
        for task, phase in list(self._phase.items()):
            if phase == "request":
                task.cancel()

    def _on_signal(self, signame: str) -> None:
        self._sigints += 1
        if self._sigints > 1:
            print(f"\nhsx extract: second {signame}, exiting now (state stays resumable)", file=sys.stderr)
            os._exit(EXIT_INTERRUPTED)
        print(
            f"\nhsx extract: {signame}: finishing stores in progress, then exiting (again to exit at once)",
            file=sys.stderr,
        )
        self.request_stop("interrupted")

    # -------------------------------------------------------------- main
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

    async def _run_locked(self) -> ExtractResult:
        from .api import HsxClient

        cfg = self.cfg
        out = self.out
        hooks = self.hooks or default_hooks()
        removed = store.clean_temp_files(out)
        plan = load_plan(out)
        if plan is None:
            if cfg.resume:
                raise ConfigError(f"--resume: {out} holds no plan.json (nothing to resume)")
            others = [p.name for p in out.iterdir() if p.name != store.LOCK_NAME]
            if others:
                raise ConfigError(
                    f"{out} is not empty and holds no hsx plan ({', '.join(sorted(others)[:5])}...); "
                    "pick an empty or new --output"
                )
        settings = _resolve_settings(cfg, plan)
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
        inputs = [_norm_input(p) for p in inputs]

        async with HsxClient(
            cfg.servers,
            api_key=cfg.api_key,
            concurrency_per_server=cfg.concurrency_per_server,
            timeout=cfg.timeout,
            max_attempts=cfg.max_attempts,
            unhealthy_cooldown=cfg.unhealthy_cooldown,
            transport=self.transport,
            compression=cfg.compression,
            transfer=cfg.transfer,
        ) as client:
            self.client = client
            info = await client.info()
            await self._check_servers_agree(client, info)
            final_norm = await client.final_norm()
            served = [int(x) for x in info["layer_ids"]]
            layers = settings["layers"]
            if layers is not None:
                layers = sorted(int(x) for x in layers)
                missing = [x for x in layers if x not in served]
                if missing:
                    raise ConfigError(f"--layers {layers}: the server serves layers {served}, not {missing}")
            else:
                layers = served
            settings["layers"] = layers

            # ---- samples and plan
            bad_rows: list[Any] = []
            samples = hooks.read_samples(inputs, mask_policy=settings["mask_policy"], bad_rows=bad_rows)
            by_key = {s.key: s for s in samples}
            if len(by_key) != len(samples):
                raise ConfigError("the inputs produced duplicate sample keys")
            fingerprint = inputs_fingerprint(samples)
            if plan is None:
                keys = [s.key for s in samples]
                if settings["shuffle"]:
                    random.Random(settings["seed"]).shuffle(keys)
                if settings["max_samples"] is not None:
                    keys = keys[: settings["max_samples"]]
                plan = {
                    "version": PLAN_VERSION,
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "settings": settings,
                    "inputs": inputs,
                    "inputs_sha256": fingerprint,
                    "num_input_samples": len(samples),
                    "bad_rows": len(bad_rows),
                    "model": info.get("model"),
                    "model_revision": info.get("model_revision"),
                    "keys": keys,
                }
                store.write_json_atomic(out / store.PLAN_NAME, plan)
            else:
                problems = []
                if plan.get("inputs_sha256") != fingerprint:
                    problems.append(
                        f"the inputs differ from the plan's ({plan.get('num_input_samples')} samples from "
                        f"{plan.get('inputs')}, now {len(samples)} from {inputs})"
                    )
                for k in ("model", "model_revision"):
                    if plan.get(k) != info.get(k):
                        problems.append(f"{k}: the plan has {plan.get(k)!r}, the server has {info.get(k)!r}")
                if plan["settings"].get("layers") != layers:
                    problems.append(f"layers: the plan has {plan['settings'].get('layers')}, now {layers}")
                if problems:
                    raise ConfigError(f"cannot resume {out}:\n  " + "\n  ".join(problems))
            keys = plan["keys"]
            n = len(keys)

            ctx = hooks.make_context(
                layer_ids=layers,
                hidden_size=int(info["hidden_size"]),
                dtype=info["dtype"],
                final_norm=final_norm,
                draft_vocab_size=settings["draft_vocab_size"],
                vocab_size=int(info["vocab_size"]) if info.get("vocab_size") is not None else None,
                mask_policy=settings["mask_policy"],
            )
            self.fmt, self.ctx, self.settings, self.info = fmt, ctx, settings, info
            try:  # what finalize needs, imported now: a missing package fails here, not after the run
                getattr(fmt, "prepare", lambda: None)()
            except ImportError as exc:
                raise ConfigError(str(exc)) from exc

            # ---- what is done
            manifest = store.JsonlLog(out / store.MANIFEST_NAME)
            failed_log = store.JsonlLog(out / store.FAILED_NAME)
            try:
                done = store.latest_by_index(manifest.entries)
                compacted = (out / COMPACTION_JOURNAL).exists()
                if compacted:
                    # finalize renumbered the samples (a format without holes): the corpus takes
                    # no more samples; only an interrupted finalize is finished below.
                    for flag, given in (("--verify", cfg.verify), ("--retry-failed", cfg.retry_failed)):
                        if given:
                            raise ConfigError(
                                f"{out} was finalized with renumbering ({COMPACTION_JOURNAL}); {flag} cannot "
                                "change it: extract into a new --output"
                            )
                    if (out / store.VERIFY_NAME).exists():
                        raise ConfigError(
                            f"{out} was finalized with renumbering ({COMPACTION_JOURNAL}) and hsx verify found bad "
                            "samples; they cannot be redone in place: extract into a new --output"
                        )
                redo = 0 if compacted else self._invalidate_from_verify(manifest, done)
                if cfg.verify:
                    rep = verify_samples(out, fmt, keys, done, quiet=cfg.quiet)
                    for b in rep:
                        manifest.append({"index": b["index"], "key": b["key"], "invalid": True, "reason": b["problems"]})
                        done.pop(b["index"], None)
                    redo += len(rep)
                for i, e in list(done.items()):
                    if i >= n or e.get("key") != keys[i]:
                        raise ConfigError(f"manifest line for index {i} does not match the plan (key {e.get('key')!r})")
                    if not compacted and store.check_sizes(out, e):
                        del done[i]
                        redo += 1
                failed = {i: e for i, e in load_failed(out).items() if i not in done and i < n}
                for i, e in list(failed.items()):
                    if not compacted and (cfg.retry_failed or e.get("kind") in ("server_error", "lease_expired")):
                        del failed[i]
                todo = [i for i in range(n) if i not in done and i not in failed]

                if todo:
                    corpus = out / store.CORPUS_NAME
                    if corpus.exists():
                        corpus.unlink()
                        store.fsync_dir(out)
                    need = sum(
                        estimate_tokens(by_key[keys[i]].request, settings["max_length"], info.get("max_model_len"))
                        for i in todo
                    ) * float(fmt.bytes_per_token(ctx)) + 4096 * len(todo)
                    disk = store.check_disk_space(out, int(need), force=cfg.force_disk)
                else:
                    disk = None

                progress = Progress(
                    n, initial=n - len(todo), quiet=cfg.quiet, server_stats=client.stats
                )
                if removed:
                    progress.write(f"removed {removed} temporary file(s) left by an earlier run")
                if redo:
                    progress.write(f"{redo} stored sample(s) were missing or broken; redoing them")
                if disk is not None and not disk.ok:
                    progress.write(
                        f"warning: need ~{store.fmt_bytes(disk.needed)}, {store.fmt_bytes(disk.free)} free (--force-disk)"
                    )
                try:
                    await self._extract(client, todo, keys, by_key, manifest, failed_log, failed, done, progress)
                finally:
                    progress.close()
                run_summary = progress.summary()
            finally:
                manifest.close()
                failed_log.close()

        failed = {i: e for i, e in load_failed(out).items() if i not in done and i < n}
        remaining = n - len(done) - len(failed)
        summary = {
            "output": str(out),
            "planned": n,
            "done": len(done),
            "failed": len(failed),
            "remaining": remaining,
            "bad_rows": plan.get("bad_rows", len(bad_rows)),
            **run_summary,
        }
        if self.fatal is not None:
            summary.update(status="error", message=f"stopped: {self.fatal} (rerun the same command to resume)")
            return ExtractResult(EXIT_ERROR, "error", summary)
        if self.stopping:
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

        corpus = self._finalize(plan, done, failed, info, final_norm, settings)
        summary.update(status="complete", corpus=str(out / store.CORPUS_NAME), tokens=corpus["counts"]["tokens"])
        if failed:
            summary["message"] = f"{len(failed)} sample(s) failed; see {out / store.FAILED_NAME}"
        return ExtractResult(EXIT_OK, "complete", summary)

    async def _check_servers_agree(self, client: Any, info: dict[str, Any]) -> None:
        if len(client.servers) < 2:
            return
        keys = ("model", "model_revision", "layer_ids", "hidden_size", "dtype")
        for url in client.servers:
            try:
                other = await asyncio.wait_for(client._get_json(client._by_url[url], "/info", "hsx-info"), 30)
            except (HsxError, asyncio.TimeoutError):
                continue  # a down server is the retry loop's business
            diffs = [k for k in keys if other.get(k) != info.get(k)]
            if diffs:
                raise ConfigError(
                    f"{url} serves something else than {client.servers[0]}: "
                    + ", ".join(f"{k}={other.get(k)!r} vs {info.get(k)!r}" for k in diffs)
                )

    def _invalidate_from_verify(self, manifest: store.JsonlLog, done: dict[int, dict[str, Any]]) -> int:
        p = self.out / store.VERIFY_NAME
        if not p.exists():
            return 0
        try:
            bad = json.loads(p.read_text()).get("bad", [])
        except ValueError:
            bad = []
        n = 0
        for b in bad:
            i = int(b["index"])
            if i in done:
                manifest.append({"index": i, "key": b.get("key"), "invalid": True, "reason": b.get("problems")})
                del done[i]
                n += 1
        p.unlink()
        store.fsync_dir(self.out)
        return n

    # -------------------------------------------------------------- fan-out
    async def _extract(
        self,
        client: Any,
        todo: list[int],
        keys: list[str],
        by_key: dict[str, Any],
        manifest: store.JsonlLog,
        failed_log: store.JsonlLog,
        failed: dict[int, dict[str, Any]],
        done: dict[int, dict[str, Any]],
        progress: Progress,
    ) -> None:
        if not todo:
            return
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        queue = deque(todo)
        total_conc = cfg.concurrency_per_server * len(client.servers)
        nw = cfg.write_workers or max(4, min(16, (os.cpu_count() or 4) * 2))
        pool = ThreadPoolExecutor(max_workers=nw, thread_name_prefix="hsx-store")
        self._breaker = max(10, 2 * total_conc)
        installed = []
        if cfg.handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig.name)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError):
                    pass

        async def ticker() -> None:
            while True:
                await asyncio.sleep(1.0)
                progress.refresh()

        tick = loop.create_task(ticker())
        try:
            workers = [
                loop.create_task(self._worker(client, queue, keys, by_key, manifest, failed_log, failed, done, progress, pool))
                for _ in range(min(len(todo), total_conc + nw))
            ]
            for w in workers:
                self._phase[w] = "idle"
            results = await asyncio.gather(*workers, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError) and self.fatal is None:
                    self.fatal = r
        finally:
            tick.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)
            pool.shutdown(wait=True)

    def _request_body(self, sample: Any) -> dict[str, Any]:
        body = dict(sample.request)
        s = self.settings
        if s["layers"] != [int(x) for x in self.info["layer_ids"]]:
            body.setdefault("layers", s["layers"])
        if s["max_length"]:
            body.setdefault("max_length", s["max_length"])
            body.setdefault("truncation", s["truncation"])
        body.setdefault("id", sample.key)
        return body

    async def _worker(
        self,
        client: Any,
        queue: deque[int],
        keys: list[str],
        by_key: dict[str, Any],
        manifest: store.JsonlLog,
        failed_log: store.JsonlLog,
        failed: dict[int, dict[str, Any]],
        done: dict[int, dict[str, Any]],
        progress: Progress,
        pool: ThreadPoolExecutor,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        try:
            while not self.stopping and queue:
                idx = queue.popleft()
                key = keys[idx]
                sample = by_key[key]
                self._phase[task] = "request"
                try:
                    fetch = getattr(self.fmt, "fetch", None)  # a format may ask for less than states
                    body = self._request_body(sample)
                    raw = await (fetch(client, body) if fetch else client.hidden_states_response(body, lease_ok=True))
                except asyncio.CancelledError:
                    if self.stopping:
                        return  # abandoned: not done, redone on resume
                    raise
                except RetriesExhaustedError as exc:
                    self._phase[task] = "idle"
                    if isinstance(exc.last_error, ServerError):
                        self._consecutive_5xx += 1
                        self._fail(failed_log, failed, progress, idx, key, "server_error", exc.last_error)
                        if self._consecutive_5xx >= self._breaker:
                            self.fatal = exc
                            self.request_stop(f"{self._consecutive_5xx} samples in a row failed with 5xx")
                        continue
                    self.fatal = exc
                    self.request_stop("servers unreachable")
                    return
                except AuthenticationError as exc:
                    self.fatal = exc
                    self.request_stop("authentication failed")
                    return
                except HsxError as exc:  # 400/422/413/other 4xx: the sample is bad
                    self._phase[task] = "idle"
                    kind = {413: "too_large"}.get(exc.status or 0, "bad_request")
                    self._fail(failed_log, failed, progress, idx, key, kind, exc)
                    continue
                self._phase[task] = "store"
                self._consecutive_5xx = 0
                try:
                    entry, written = await asyncio.shield(
                        loop.run_in_executor(pool, self._store_sample, idx, key, raw, manifest)
                    )
                    if raw.lease is not None:
                        # The files were written from the server's arena: they count only
                        # if the lease was still ours when we were done (see service/lease.py).
                        raw.lease, lease = None, raw.lease
                        try:
                            await client.release_lease(lease)
                        except LeaseExpiredError as exc:
                            self._phase[task] = "idle"
                            redos = self._lease_redos[idx] = self._lease_redos.get(idx, 0) + 1
                            if redos >= _LEASE_REDOS:  # the store keeps outlasting the lease
                                exc.message += (f" ({redos} times: raise the server's --lease-timeout, "
                                                "or use --transfer http)")
                                self._fail(failed_log, failed, progress, idx, key, "lease_expired", exc)
                                continue
                            log.warning("sample %d: %s; requesting it again", idx, exc)
                            queue.append(idx)
                            continue
                        await loop.run_in_executor(pool, manifest.append, entry)
                except SampleEncodeError as exc:
                    self._phase[task] = "idle"
                    self._fail(failed_log, failed, progress, idx, key, "encode", exc)
                    continue
                except asyncio.CancelledError:
                    return
                except BaseException as exc:  # disk full, a bug: stop, resumable
                    self.fatal = exc
                    self.request_stop(f"storing failed: {exc}")
                    return
                finally:
                    if raw.lease is not None:  # not stored: give the range back now
                        with contextlib.suppress(HsxError):
                            await client.release_lease(raw.lease)
                self._phase[task] = "idle"
                done[idx] = entry
                progress.sample_done(tokens=entry["tokens"], wire_bytes=raw.wire_bytes, written_bytes=written)
        finally:
            self._phase.pop(task, None)

    def _fail(
        self,
        failed_log: store.JsonlLog,
        failed: dict[int, dict[str, Any]],
        progress: Progress,
        idx: int,
        key: str,
        kind: str,
        exc: BaseException,
    ) -> None:
        entry: dict[str, Any] = {"index": idx, "key": key, "kind": kind, "time": time.time()}
        if isinstance(exc, HsxError):
            entry.update(
                status=exc.status, type=exc.type, message=exc.message, request_id=exc.request_id, server=exc.server
            )
        else:
            entry.update(message=f"{type(exc).__name__}: {exc}")
        failed_log.append(entry)
        failed[idx] = entry
        progress.sample_failed()

    def _store_sample(self, idx: int, key: str, raw: Any, manifest: store.JsonlLog) -> tuple[dict[str, Any], int]:
        """In a pool thread: decode, encode, write files, then the manifest line (for a
        lease, the caller appends it once the lease is released)."""
        try:
            decoded = raw.decode()
            out = self.fmt.encode_sample(idx, decoded, self.ctx)
        except Exception as exc:
            raise SampleEncodeError(f"{type(exc).__name__}: {exc}") from exc
        files = store.write_files_atomic(self.out, out.files)
        entry = {
            "key": key,
            "index": idx,
            "files": files,
            "record": out.record,
            "tokens": int(len(decoded.token_ids)),
            "request_id": raw.request_id,
        }
        if raw.lease is None:
            manifest.append(entry)
        return entry, sum(f["size"] for f in files.values())

    # -------------------------------------------------------------- finalize
    def _finalize(
        self,
        plan: dict[str, Any],
        done: dict[int, dict[str, Any]],
        failed: dict[int, dict[str, Any]],
        info: dict[str, Any],
        final_norm: Any,
        settings: dict[str, Any],
    ) -> dict[str, Any]:
        records = sorted((i, e["record"]) for i, e in done.items())
        written = list(self.fmt.finalize(self.out, records, self.ctx) or [])
        for rel in written:
            store.fsync_dir((self.out / rel).parent)
        corpus = {
            "hsx_corpus_version": 1,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "format": settings["format"],
            "states": settings["states"],
            "states_dtype": settings["dtype"],
            "model": info.get("model"),
            "model_revision": info.get("model_revision"),
            "layer_ids": settings["layers"],
            "last_layer_pre_norm": True,
            "num_hidden_layers": info.get("num_hidden_layers"),
            "hidden_size": info.get("hidden_size"),
            "dtype": info.get("dtype"),
            "vocab_size": info.get("vocab_size"),
            "max_model_len": info.get("max_model_len"),
            "chat_template_sha256": info.get("chat_template_sha256"),
            "final_norm": {"eps": getattr(final_norm, "eps", None), "style": getattr(final_norm, "style", None)},
            "max_length": settings["max_length"],
            "truncation": settings["truncation"] if settings["max_length"] else None,
            "mask_policy": settings["mask_policy"],
            "draft_vocab_size": settings["draft_vocab_size"],
            "seed": settings["seed"],
            "shuffle": settings["shuffle"],
            "max_samples": settings["max_samples"],
            "inputs": plan.get("inputs"),
            "inputs_sha256": plan.get("inputs_sha256"),
            "versions": {
                "vllm": info.get("vllm_version"),
                "hsx_server": info.get("hsx_version"),
                "hsx_client": _client_version(),
            },
            "counts": {
                "planned": len(plan["keys"]),
                "done": len(done),
                "failed": len(failed),
                "bad_rows": plan.get("bad_rows", 0),
                "input_samples": plan.get("num_input_samples"),
                "tokens": sum(int(e.get("tokens", 0)) for e in done.values()),
            },
            "failed_indices": sorted(failed),
            "finalize_files": _files_digest(self.out, written),
        }
        store.write_json_atomic(self.out / store.CORPUS_NAME, corpus)
        return corpus


def _client_version() -> str:
    try:
        from hsx import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "?"


def run_extract(cfg: ExtractConfig, hooks: Hooks | None = None, *, transport: Any = None) -> ExtractResult:
    """Synchronous entry (the CLI's); from async code use `await Extractor(cfg).run()`."""
    return asyncio.run(Extractor(cfg, hooks, transport=transport).run())


# ---------------------------------------------------------------- verify
def verify_samples(
    out: Path,
    fmt: Any,
    keys: list[str],
    done: dict[int, dict[str, Any]],
    *,
    workers: int | None = None,
    quiet: bool = True,
) -> list[dict[str, Any]]:
    """Full check of stored samples: sizes, checksums, then `fmt.verify_sample`."""
    out = Path(out)
    moved = _compaction_moves(out)

    def one(item: tuple[int, dict[str, Any]]) -> dict[str, Any] | None:
        i, e = item
        problems: list[str] = []
        if i >= len(keys) or e.get("key") != keys[i]:
            problems.append(f"manifest key {e.get('key')!r} is not the plan's for index {i}")
        now = moved.get(i, i)
        if now != i:  # renumbered by finalize: same bytes under the new index's name
            e = dict(e, files={_renumber(fmt, rel, i, now): m for rel, m in e.get("files", {}).items()})
        problems += store.check_checksums(out, e)
        if not problems:
            try:
                problems += list(fmt.verify_sample(out, now, e.get("record", {})) or [])
            except Exception as exc:  # a reader error is a bad sample
                problems.append(f"verify_sample raised {type(exc).__name__}: {exc}")
        return {"index": i, "key": e.get("key"), "problems": problems} if problems else None

    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(done), desc="verify", unit="sample", file=sys.stderr, dynamic_ncols=True)
    bad = []
    with ThreadPoolExecutor(max_workers=workers or max(2, min(16, (os.cpu_count() or 2)))) as pool:
        for r in pool.map(one, sorted(done.items())):
            if bar is not None:
                bar.update(1)
            if r is not None:
                bad.append(r)
    if bar is not None:
        bar.close()
    return bad


def _compaction_moves(out: Path) -> dict[int, int]:
    p = Path(out) / COMPACTION_JOURNAL
    if not p.exists():
        return {}
    return {int(a): int(b) for a, b in json.loads(p.read_text()).get("moves", [])}


def _renumber(fmt: Any, rel: str, old: int, new: int) -> str:
    """The path of a sample file after finalize moved sample `old` to `new`."""
    for attr in ("hs_path", "ckpt_path"):
        fn = getattr(fmt, attr, None)
        if fn is not None and fn(old) == rel:
            return fn(new)
    return rel


def verify_corpus(out: Path, hooks: Hooks | None = None, *, quiet: bool = True, workers: int | None = None) -> dict[str, Any]:
    """`hsx verify DIR`: returns the report; writes DIR/verify.json listing bad samples
    (removed when none) so the next `hsx extract` redoes exactly those."""
    out = Path(out)
    if not (out / store.PLAN_NAME).exists():
        raise ConfigError(f"{out} is not an hsx corpus (no {store.PLAN_NAME})")
    with store.DirLock(out).acquire("hsx verify"):
        hooks = hooks or default_hooks()
        plan = load_plan(out)
        assert plan is not None
        keys = plan["keys"]
        n = len(keys)
        from .formats import format_options

        fmt = hooks.get_format(plan["settings"]["format"], **format_options(plan["settings"]))
        entries, _, torn = store.read_jsonl(out / store.MANIFEST_NAME)
        done = store.latest_by_index(entries)
        problems: list[str] = []
        extra = [i for i in done if i >= n]
        if extra:
            problems.append(f"manifest has indices beyond the plan's {n}: {extra[:10]}")
            for i in extra:
                del done[i]
        failed = {i: e for i, e in load_failed(out).items() if i not in done and i < n}
        bad = verify_samples(out, fmt, keys, done, workers=workers, quiet=quiet)
        missing = [i for i in range(n) if i not in done and i not in failed]
        if missing:
            problems.append(f"{len(missing)} planned sample(s) not extracted yet (first: {missing[:10]})")
        corpus_path = out / store.CORPUS_NAME
        if not corpus_path.exists():
            problems.append(f"no {store.CORPUS_NAME}: the run was not finalized")
        else:
            corpus = json.loads(corpus_path.read_text())
            counts = corpus.get("counts", {})
            if counts.get("planned") != n or counts.get("done") != len(done) or counts.get("failed") != len(failed):
                problems.append(
                    f"{store.CORPUS_NAME} counts {counts.get('planned')}/{counts.get('done')}/{counts.get('failed')} "
                    f"(planned/done/failed) do not match the manifest {n}/{len(done)}/{len(failed)}"
                )
            for rel, meta in (corpus.get("finalize_files") or {}).items():
                try:
                    size, digest = store.hash_file(out / rel)
                except FileNotFoundError:
                    problems.append(f"finalize output {rel} is missing")
                    continue
                if size != meta.get("size") or digest != meta.get(store.HASH_ALGO):
                    problems.append(f"finalize output {rel} changed since finalize (size/checksum)")
        report = {
            "ok": not bad and not problems,
            "output": str(out),
            "planned": n,
            "done": len(done),
            "failed": len(failed),
            "missing": len(missing),
            "bad_samples": len(bad),
            "bad": bad,
            "problems": problems,
            "torn_manifest_lines": torn,
        }
        vpath = out / store.VERIFY_NAME
        if bad:
            store.write_json_atomic(vpath, {"checked_at": time.time(), "bad": bad})
        elif vpath.exists():
            vpath.unlink()
            store.fsync_dir(out)
        return report


__all__ = [
    "ExtractConfig",
    "ExtractResult",
    "Extractor",
    "Hooks",
    "run_extract",
    "verify_corpus",
    "verify_samples",
    "estimate_tokens",
    "format_summary",
]
