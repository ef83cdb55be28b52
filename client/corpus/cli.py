"""`hsx extract`, `hsx verify` and `hsx merge` command lines (argparse; `hsx` dispatches here).

Environment variables give defaults for the connection flags (hsx_client.settings):
HSX_SERVER (comma-separated URLs), HSX_API_KEY, HSX_CONCURRENCY_PER_SERVER, HSX_TIMEOUT,
HSX_MAX_ATTEMPTS, HSX_COMPRESSION, HSX_TRANSFER. A flag on the command line wins.

Corpus settings left out take the saved plan's value when DIR already holds a run, else the
defaults shown in --help; a value that differs from the plan's is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import Any
from pathlib import Path

from pydantic import ValidationError

from hsx.exit_codes import ExitCode
from hsx.sizes import parse_bytes
from hsx_client.settings import COMPRESSIONS, DEFAULTS, TRANSFERS, ClientSettings, default_workers
from hsx_client.corpus.drafts import DRAFTS, layers_help

def exit_codes_help() -> str:
    """extract.EXIT_CODES as the help's table: the codes' one text."""
    from hsx_client.corpus.extract import EXIT_CODES

    wrap = textwrap.TextWrapper(width=88, subsequent_indent=" " * 7, break_on_hyphens=False)
    return "exit codes:\n" + "".join(f"  {code:<4} " + wrap.fill(text) + "\n" for code, text in EXIT_CODES.items())


EXTRACT_EPILOG = """
Defaults that come from the servers: --max-length is the smallest max_tokens_per_request
of the servers (recorded in the plan), longer samples are cut by --truncation (right).
The summary counts what was cut, dropped and failed, by reason; unusable input rows are
listed (file:line) in DIR/bad_rows.jsonl.

Resume: rerun the same command (or `--resume` to insist that DIR holds a run). Samples
whose files are missing or of the wrong size are redone; after `hsx verify DIR` found bad
samples (listed in DIR/verify.json), the next run redoes exactly those; `--verify` re-checks
every stored sample's checksum before resuming.
"""


# The connection flags, ClientSettings' fields of the same names.
CONNECTION_FLAGS = ("concurrency_per_server", "compression", "transfer", "api_key", "timeout", "max_attempts")


def _layers(s: str) -> list[int]:
    try:
        return sorted({int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants comma-separated integers, got {s!r}") from None


def _positive(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {s}")
    return v


def drafts_help() -> str:
    return ("\ndrafts and layers (N = the model's num_hidden_layers; the server must capture them: "
            "hsx serve --layers ...):\n" + layers_help() + "\n")


def build_extract_parser(env: ClientSettings | None = None) -> argparse.ArgumentParser:
    """`env`: the defaults of the connection flags (ClientSettings() reads HSX_*)."""
    env = env or DEFAULTS
    p = argparse.ArgumentParser(
        prog="hsx extract",
        description="Fan a dataset out over hsx servers and write a draft-model training corpus "
                    "(EAGLE-3 by default; --draft).",
        epilog=exit_codes_help() + EXTRACT_EPILOG + drafts_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--server", action="append", dest="servers", metavar="URL",
                   help="hsx server base URL (repeat for several; env HSX_SERVER, comma-separated)")
    p.add_argument("--input", action="append", dest="inputs", metavar="FILE",
                   help="JSONL/JSON file, dataset dir or hf:org/name[:split] (repeat for several)")
    p.add_argument("--output", required=True, type=Path, metavar="DIR", help="corpus directory")
    p.add_argument("--format", choices=["speculators", "specforge"], help="corpus format (required for a new DIR)")
    p.add_argument("--mask-policy", choices=["per_turn", "all_turns"],
                   help="per_turn: one sample per assistant turn (speculators' way); all_turns: every "
                        "assistant turn of a conversation in one sample (SpecForge's). Default per_turn")
    p.add_argument("--max-length", type=_positive, metavar="N",
                   help="cut samples to N tokens (default: the servers' max_tokens_per_request)")
    p.add_argument("--truncation", choices=["right", "left", "error"],
                   help="over --max-length: keep the start (right), the end (left: keeps the last, supervised "
                        "turn), or fail the sample (error). Default right; a cut sample left with no "
                        "supervised token is dropped")
    p.add_argument("--draft", choices=list(DRAFTS),
                   help="the draft model the corpus trains: its layers and the records its trainer reads "
                        "(default eagle3; see 'drafts and layers' below)")
    p.add_argument("--layers", type=_layers, metavar="2,8,13,16",
                   help="layer ids (default: all the server serves; they must fit --draft, checked before any sample)")
    p.add_argument("--draft-vocab-size", type=_positive, metavar="K", help="write the top-K draft vocab mapping")
    p.add_argument("--states", choices=["all", "none"],
                   help="none: write only speculators' token table (POST /tokenize, no engine pass) for "
                        "online training with the hsx backend (docs/online-training.md). Default all")
    p.add_argument("--dtype", choices=["auto", "fp8"],
                   help="fp8: store the states as float8_e4m3fn with per-token scales, as speculators' fp8 "
                        "backend reads them (--format speculators). Default auto: the served dtype")
    p.add_argument("--seed", type=int, help="shuffle seed (default 0)")
    p.add_argument("--shuffle", dest="shuffle", action="store_true", default=None, help="shuffle samples (default)")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="keep the input order")
    p.add_argument("--max-samples", type=_positive, metavar="N", help="only the first N planned samples (after shuffling)")
    p.add_argument("--shard", metavar="I/N",
                   help="extract slice I (0-based) of N of the global plan into DIR, for `hsx merge` (default from "
                        "JOB_COMPLETION_INDEX or SLURM_ARRAY_TASK_ID, with the count from --num-shards)")
    p.add_argument("--num-shards", type=_positive, metavar="N",
                   help="shard count when the index comes from --shard I or the scheduler (env HSX_NUM_SHARDS; "
                        "Slurm: SLURM_ARRAY_TASK_COUNT)")
    p.add_argument("--concurrency-per-server", type=_positive, default=env.concurrency_per_server,
                   help=f"requests in flight per server (default {DEFAULTS.concurrency_per_server})")
    p.add_argument("--compression", choices=COMPRESSIONS, default=env.compression,
                   help="response compression: zstd (~1.27x), bf16split (bf16 exponent planes, ~1.5x; zstd for "
                        "other dtypes), none; auto = none from local servers, zstd from servers on "
                        "other hosts (bf16split measured slower to decode, bench/README.md) (default auto; env HSX_COMPRESSION)")
    p.add_argument("--transfer", choices=TRANSFERS, default=env.transfer,
                   help="auto: a server on this host hands over the states in shared memory (a lease) "
                        "instead of an HTTP body, when it offers that and this process may map it (the "
                        "states are copied out at once; a sample whose lease expired is asked again over "
                        "HTTP); http: always bodies (default auto; env HSX_TRANSFER)")
    p.add_argument("--workers", type=_positive, default=default_workers(), metavar="N",
                   help="processes that receive, decode, hash and write samples, each with its own "
                        "connections; this process alone writes the manifest (crash safety and resume "
                        "unchanged). 1: all in this process. --concurrency-per-server is shared among "
                        "them, and bounds them (each holds a request per server) "
                        f"(default min(cores, 16), 1 on <= 2 cores: {default_workers()} here)")
    p.add_argument("--max-buffer-bytes", type=_byte_size, metavar="BYTES",
                   help="memory the client may hold in responses at once (e.g. 512MiB, 4GiB); requests wait for "
                        "room. A sample streams into its file through a buffer of its own, so one larger than this "
                        "still passes (default: a quarter of the memory available, container limit included)")
    p.add_argument("--api-key", default=env.api_key, help="bearer token (env HSX_API_KEY)")
    p.add_argument("--timeout", type=float, default=env.timeout,
                   help=f"seconds per request (default {DEFAULTS.timeout:.0f})")
    p.add_argument("--max-attempts", type=_positive, default=env.max_attempts,
                   help=f"attempts per request before giving up (default {DEFAULTS.max_attempts})")
    p.add_argument("--resume", action="store_true", help="require DIR to hold a run, and continue it")
    p.add_argument("--verify", action="store_true", help="before resuming, re-check every stored sample's checksum")
    p.add_argument("--retry-failed", action="store_true", help="retry samples that failed with a 4xx or encode error")
    p.add_argument("--force-disk", action="store_true", help="run even when the disk estimate exceeds free space")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars (the end summary still prints)")
    return p


def _byte_size(text: str) -> int:
    """`4GiB`, `512MiB`, `1e9`, `800MB` -> bytes (hsx.sizes)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env_settings() -> ClientSettings:
    """ClientSettings() with a bad HSX_* value turned into a one-line usage error."""
    try:
        return ClientSettings()
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "HSX_" + str(err["loc"][0]).upper() if err.get("loc") else "HSX_*"
        print(f"hsx extract: {name}={err.get('input')!r}: {err['msg']}", file=sys.stderr)
        raise SystemExit(ExitCode.REFUSED) from None


def extract_config(argv: list[str] | None = None) -> Any:
    """`hsx extract ARGV` as (ExtractConfig, the parsed arguments), or the exit code refusing it."""
    env = _env_settings()
    args = build_extract_parser(env).parse_args(argv)
    servers = args.servers or env.server
    if not servers:
        print("hsx extract: give at least one --server URL (or HSX_SERVER)", file=sys.stderr)
        return ExitCode.REFUSED
    from hsx_client.corpus.extract import ExtractConfig
    from hsx_client.corpus.shard import ShardError, resolve

    try:
        shard = resolve(args.shard, args.num_shards, os.environ)
    except ShardError as exc:
        print(f"hsx extract: {exc}", file=sys.stderr)
        return ExitCode.REFUSED

    flags = {k: getattr(args, k) for k in CONNECTION_FLAGS}  # their defaults: the environment's values
    cfg = ExtractConfig(
        client=ClientSettings.given(servers, **{**env.model_dump(exclude={"server"}), **flags}),
        output=args.output,
        inputs=args.inputs,
        format=args.format,
        mask_policy=args.mask_policy,
        max_length=args.max_length,
        truncation=args.truncation,
        layers=args.layers,
        draft_vocab_size=args.draft_vocab_size,
        seed=args.seed,
        shuffle=args.shuffle,
        max_samples=args.max_samples,
        states=args.states,
        dtype=args.dtype,
        draft=args.draft,
        resume=args.resume,
        verify=args.verify,
        retry_failed=args.retry_failed,
        force_disk=args.force_disk,
        quiet=args.quiet,
        workers=args.workers,
        max_buffer_bytes=args.max_buffer_bytes,
        handle_signals=True,
        shard=shard,
    )
    return cfg, args


def extract_main(argv: list[str] | None = None) -> int:
    parsed = extract_config(argv)
    if not isinstance(parsed, tuple):
        return parsed
    cfg, args = parsed
    from hsx_client.corpus.extract import format_summary, run_extract
    from hsx_client.malloc_tuning import keep_large_blocks

    keep_large_blocks()  # this process receives the bodies unless --workers does (hsx_client.malloc_tuning)
    try:
        result = run_extract(cfg)
    except KeyboardInterrupt:  # before the handlers were installed
        print("hsx extract: interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130
    summary = dict(result.summary)
    summary.setdefault("status", result.status)
    if result.status == "refused" or "planned" not in summary:  # nothing ran: the reason alone
        print(f"hsx extract: {summary.get('message')}", file=sys.stderr)
    else:  # --quiet hides the progress bar, never what the run did
        print(format_summary(summary), file=sys.stderr)
    if args.json:
        summary["exit_code"] = result.exit_code
        print(json.dumps(summary, indent=1, default=str))
    return result.exit_code


def _report_flags(p: argparse.ArgumentParser, what: str) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help=f"print the {what} as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def build_verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsx verify",
        description="Re-check a corpus: counts against the plan, every file's size and checksum, "
        "shapes and token/mask agreement (the format's own check), finalize outputs. Bad samples "
        "are listed in DIR/verify.json; the next `hsx extract` on DIR redoes exactly those.",
    )
    p.add_argument("dir", type=Path, metavar="DIR")
    p.add_argument("--workers", type=_positive, help="checking threads (default: usable cores, at most 16)")
    return _report_flags(p, "report")


def verify_main(argv: list[str] | None = None) -> int:
    args = build_verify_parser().parse_args(argv)
    from hsx_client.corpus.plan import ConfigError
    from hsx_client.corpus.store import StoreError
    from hsx_client.corpus.verify import verify_corpus

    try:
        report = verify_corpus(args.dir, quiet=args.quiet, workers=args.workers)
    except (ConfigError, StoreError) as exc:
        print(f"hsx verify: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    if args.json:
        print(json.dumps(report, indent=1))
    for b in report["bad"][:100]:
        print(f"BAD {b['index']} ({b['key']}): {'; '.join(b['problems'])}", file=sys.stderr)
    if len(report["bad"]) > 100:
        print(f"... and {len(report['bad']) - 100} more (see {args.dir / 'verify.json'})", file=sys.stderr)
    for p in report["problems"]:
        print(f"PROBLEM: {p}", file=sys.stderr)
    print(verify_verdict(report), file=sys.stderr)
    if report["bad"] or report["missing"]:
        print(repair_advice(args.dir, report), file=sys.stderr)
    return ExitCode.OK if report["ok"] else ExitCode.FAILED


def verify_verdict(report: dict) -> str:
    """The last line of `hsx verify`: the counts its files hold (a merged corpus's failed and
    dropped samples are its shards', by the merge's record)."""
    verdict = "OK" if report["ok"] else "FAILED"
    merged = report.get("merged")
    stored = f"{report['done']}/{merged['global_planned'] if merged else report['planned']} samples stored"
    if merged:
        stored += f" (merged from {len(merged['shards'])} shards)"
    where = " in the shards" if merged else ""
    return (f"verify {verdict}: {stored}, {report['failed']} failed at extraction{where}, "
            f"{report.get('dropped', 0)} dropped (no supervised token){where}, {report['missing']} missing, "
            f"{report['bad_samples']} bad")


def repair_advice(out: Path, report: dict) -> str:
    if not report.get("merged"):
        return f"rerun `hsx extract --output {out}` (with its --server) to redo the bad or missing samples"
    merged = report["merged"]
    shared = [s["path"] for s in merged["shards"] if s["index"] in merged.get("shards_sharing_bad_files", [])]
    return (f"rerun `hsx extract --output {out}` (with its --server) to extract the bad or missing samples again "
            "in place (a repaired file replaces the merged corpus's link; the shard keeps its own), or repair the "
            f"shards (`hsx verify SHARD`, then its `hsx extract`) and rerun `hsx merge {out} SHARD...`"
            + (f"; the bad files are hard links into {', '.join(shared)}, which holds the same damage: "
               "`hsx verify` it too" if len(shared) == 1 else
               f"; the bad files are hard links into {', '.join(shared)}, which hold the same damage: "
               "`hsx verify` them too" if shared else ""))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(extract_main())


def build_merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsx merge",
        description="Merge the shards of one sharded run (`hsx extract --shard I/N`) into one corpus OUT. Files are "
                    "hard-linked from the shards (copied, checksummed, across filesystems); the shards stay intact.",
        epilog="exit codes: 0 merged; 1 stopped on an error (rerun the same command to resume); 2 refused (the "
               "shards disagree, are incomplete, miss or repeat an index; OUT is in use or holds something else); "
               "130 interrupted (rerun to resume).",
    )
    p.add_argument("out", type=Path, metavar="OUT", help="the merged corpus directory (new, or an interrupted merge)")
    p.add_argument("shards", type=Path, nargs="+", metavar="SHARD_DIR", help="every shard's corpus directory")
    p.add_argument("--workers", type=int, help="threads placing files (default: 2 x usable cores, at most 8)")
    return _report_flags(p, "summary")


def merge_main(argv: list[str] | None = None) -> int:
    from hsx_client.corpus.merge import run_merge

    args = build_merge_parser().parse_args(argv)
    result = run_merge(args.out, args.shards, workers=args.workers, quiet=args.quiet)
    s = result.summary
    if result.status == "refused":
        for line in s["problems"]:
            print(f"hsx merge: {line}", file=sys.stderr)
    elif result.status != "complete":
        print(f"hsx merge: {s['message']}", file=sys.stderr)
    else:
        print(f"hsx merge: {s['shards']} shards -> {s['samples']} samples, {s['tokens']} tokens in {s['output']} "
              f"({s['linked']} files linked, {s['copied']} copied"
              + (f", {s['rewritten']} rewritten without their shard's index" if s.get("rewritten") else "")
              + (f", {s['refreshed']} placed again: their shard changed" if s.get("refreshed") else "")
              + f", {s['seconds']} s)"
              + (f"; {s['failed_in_shards']} sample(s) had failed in their shards" if s["failed_in_shards"] else "")
              + (f"; {s['dropped_in_shards']} sample(s) were dropped in their shards (no supervised token)"
                 if s.get("dropped_in_shards") else "")
              + (f"; {s['message']}" if s.get("message") else ""), file=sys.stderr)
    if args.json:
        print(json.dumps({**s, "status": result.status, "exit_code": result.exit_code}, indent=1, default=str))
    return result.exit_code
