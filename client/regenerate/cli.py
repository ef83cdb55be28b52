"""`hsx regenerate` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from hsx.exit_codes import ExitCode
from hsx_client.settings import DEFAULTS, ClientSettings

from .mix import MixError, load_mix
from .run import RegenConfig, run_regenerate
from .turns import Sampling

EPILOG = """\
With --extract-to DIR the corpus is written too: against hsx serve (prefix caching on) in
one pass, each sample's states read from the KV pages its generation wrote, as the
conversations finish (crash-safe and resumable like hsx extract; rerun the same command);
against any other server (or with --two-pass) by hsx extract of the output afterwards.

Each assistant turn of every input conversation is generated again by the served model,
against its own earlier replies (user, system and tool turns as recorded). The output is
a chat JSONL `hsx extract` reads token-exactly: each row's `hsx_turns` holds every
regenerated turn's prompt and generated token ids and its finish reason.

exit codes (as hsx extract's):
  0    complete
  1    finished with failed conversations, or stopped on an error (rerun to resume)
  2    refused before any work: usage, no usable input rows, sampling settings the
       server refuses (one max_tokens 1 request with them is sent first), settings differ
       from the plan in OUTPUT.hsx-regen/ once it holds a conversation, output locked, an
       endpoint that returns no token ids
  130  interrupted (rerun the same command to resume)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hsx regenerate", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Regenerate the assistant turns of a chat dataset with the target model.")
    p.add_argument("--server", action="append", dest="servers", metavar="URL",
                   help="hsx serve, or any OpenAI-compatible server returning token ids (vllm serve); repeat for several "
                        "(env HSX_SERVER, comma-separated)")
    p.add_argument("--input", action="append", dest="inputs", required=True, metavar="FILE",
                   help="the inputs hsx extract reads (repeat for several)")
    p.add_argument("--output", required=True, type=Path, metavar="PATH", help="chat JSONL to write")
    p.add_argument("--max-tokens", type=int, metavar="N", help="tokens per generated turn at most (default: the "
                                                                   "room left in the model's context)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="run seed: each conversation's seed is derived from it and the "
                                           "conversation's key, so a resumed run samples the same replies")
    p.add_argument("--chat-template-kwargs", type=json.loads, metavar="JSON",
                   help='template switches, e.g. \'{"enable_thinking": true}\'')
    p.add_argument("--mix", metavar="JSON|YAML|FILE",
                   help="per-conversation variants: a list of {name, weight, temperature, top_p, max_tokens, "
                        "chat_template_kwargs, reasoning_effort}, inline or a file; each conversation gets one, "
                        "drawn from --seed and its key (the same on resume), recorded in its row")
    p.add_argument("--stop-at-length", action="store_true",
                   help="end a conversation at a turn cut by --max-tokens (default: go on; cut turns are flagged "
                        "finish_reason=length and counted)")
    p.add_argument("--model", help="model name sent with each request (needed by some OpenAI-compatible servers)")
    p.add_argument("--shard", metavar="I/N", help="regenerate conversations j with j %% N == I only")
    p.add_argument("--max-conversations", type=int, metavar="N", help="only the first N conversations")
    p.add_argument("--concurrency-per-server", type=int, default=DEFAULTS.concurrency_per_server)
    p.add_argument("--api-key", default=DEFAULTS.api_key, help="bearer token (env HSX_API_KEY)")
    p.add_argument("--timeout", type=float, default=DEFAULTS.timeout)
    p.add_argument("--max-attempts", type=int, default=DEFAULTS.max_attempts)
    p.add_argument("--extract-to", type=Path, metavar="DIR",
                   help="also write the corpus into DIR (arguments after -- go to hsx extract): against hsx serve "
                        "with prefix caching, in one pass (each conversation's states read from the pages its "
                        "generation wrote); against other servers, hsx extract of the output afterwards")
    p.add_argument("--two-pass", action="store_true",
                   help="with --extract-to: regenerate everything, then hsx extract the output (a second prefill)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _shard(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    i, _, n = text.partition("/")
    try:
        index, count = int(i), int(n)
    except ValueError:
        raise SystemExit(f"hsx regenerate: --shard wants I/N, got {text!r}") from None
    if not 0 <= index < count:
        raise SystemExit(f"hsx regenerate: --shard {text}: I must be in 0..N-1")
    return index, count


def summary_line(s: dict) -> str:
    """The text summary: what the output holds (this run's rows and earlier runs' alike, so
    a resumed run says what an uninterrupted one does), every drop, then this run's rate."""
    out = s["in_output"]
    before = out["rows"] - s["regenerated"]
    where = f"in {s['output']}" if s.get("output_written", True) else "journaled (the output is written at the end)"
    text = (f"hsx regenerate: {out['rows']} of {s['planned']} conversations {where}"
            + (f" ({s['regenerated']} regenerated by this run, {before} by earlier runs)" if before else "")
            + f", {out['turns']} turns, {out['generated_tokens']} generated tokens, {out['length_cut_turns']} turns "
            f"cut at their length limit (--max-tokens, or the room left in the context)")
    if s["dropped_context_full"]:
        text += (f"; {s['dropped_context_full']} dropped: no room in the model's context for their first reply "
                 f"(e.g. {', '.join(s['dropped_examples'])})")
    if s["failed"]:
        examples = s.get("failed_example_by_reason", {})
        text += f"; {s['failed']} failed (" + "; ".join(
            f"{reason} {n}" + (f", e.g. {examples[reason]}" if reason in examples else "")
            for reason, n in s["failed_by_reason"].items()) + ")"
    if s["bad_rows"]:
        text += f"; {s['bad_rows']} bad input rows {s['bad_rows_by_kind']}"
    return text + f"; this run {s['generated_tokens']} tokens at {s['generated_tokens_per_s']:.0f} tok/s"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extract_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extract_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    servers = args.servers or [s for s in os.environ.get("HSX_SERVER", "").split(",") if s.strip()]
    if not servers:
        print("hsx regenerate: give at least one --server URL (or HSX_SERVER)", file=sys.stderr)
        return ExitCode.REFUSED
    try:
        shard = _shard(args.shard)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return ExitCode.REFUSED
    try:
        mix = load_mix(args.mix) if args.mix else None
    except (MixError, OSError) as exc:
        print(f"hsx regenerate: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                        chat_template_kwargs=args.chat_template_kwargs, model=args.model,
                        stop_at_length=args.stop_at_length, mix=mix)
    client = ClientSettings.given(servers, api_key=args.api_key, concurrency_per_server=args.concurrency_per_server,
                                  timeout=args.timeout, max_attempts=args.max_attempts)
    cfg = RegenConfig(client=client, inputs=args.inputs, output=args.output, sampling=sampling, shard=shard,
                      max_conversations=args.max_conversations, quiet=args.quiet)
    if args.extract_to is not None:
        chained = ["--input", str(args.output), "--output", str(args.extract_to)]
        for url in servers:
            chained += ["--server", url]
        if args.api_key:
            chained += ["--api-key", args.api_key]
        chained += ["--concurrency-per-server", str(args.concurrency_per_server)]  # one pass: what drives it
        route, reason = asyncio.run(choose_route(cfg, args.two_pass))
        print(f"hsx regenerate: {route}: {reason}", file=sys.stderr)
        if route == ONE_PASS:
            return _one_pass_main(cfg, chained + extract_args, args.json)
    try:
        result = asyncio.run(run_regenerate(cfg))
    except KeyboardInterrupt:
        print("hsx regenerate: interrupted; rerun the same command to resume", file=sys.stderr)
        return ExitCode.INTERRUPTED
    s = result.summary
    if args.json:
        print(json.dumps({**s, "exit_code": result.exit_code}))
    else:
        if "error" in s:
            print(f"hsx regenerate: {s['error']}", file=sys.stderr)
        if "planned" in s:
            print(summary_line(s), file=sys.stderr)
    if result.exit_code != 0 or args.extract_to is None:
        return result.exit_code
    from hsx_client.corpus.cli import extract_main

    return extract_main(chained + extract_args)


ONE_PASS, TWO_PASS = "one pass", "two passes"


async def choose_route(cfg: RegenConfig, two_pass: bool) -> tuple[str, str]:
    """(ONE_PASS or TWO_PASS, why) for --extract-to against cfg's servers."""
    if two_pass:
        return TWO_PASS, "--two-pass: regenerating, then hsx extract of the output (a second prefill)"
    from hsx_client import HsxClient

    from .one_pass import one_pass_refusal

    async with HsxClient.from_settings(cfg.client, transport=cfg.transport) as client:
        refusal = await one_pass_refusal(client)
    if refusal is not None:
        return TWO_PASS, f"{refusal}; regenerating, then hsx extract of the output (a second prefill)"
    return ONE_PASS, "each conversation's states are read from the pages its generation wrote (one prefill)"


def _one_pass_main(cfg: RegenConfig, extract_argv: list[str], as_json: bool) -> int:
    from hsx_client.corpus.cli import extract_config
    from hsx_client.corpus.extract import format_summary

    from .one_pass import run_one_pass

    parsed = extract_config(extract_argv)
    if not isinstance(parsed, tuple):
        return parsed
    try:
        code, s = asyncio.run(run_one_pass(cfg, parsed[0]))
    except KeyboardInterrupt:
        print("hsx regenerate: interrupted; rerun the same command to resume", file=sys.stderr)
        return ExitCode.INTERRUPTED
    if "error" in s:
        print(f"hsx regenerate: {s['error']}", file=sys.stderr)
    x = s.get("extract", {})
    if x.get("status") == "refused" or ("planned" not in x and x):
        print(f"hsx extract: {x.get('message')}", file=sys.stderr)
    elif x:
        out = s["in_output"]
        print(f"hsx regenerate: {out['rows']} of {s['planned']} conversations in {s['output']}, {out['turns']} turns, "
              f"{out['generated_tokens']} generated tokens ({s['regenerated']} conversations regenerated by this "
              f"run, {s['dropped_this_run']} dropped: no room for their first reply)", file=sys.stderr)
        print(format_summary(x), file=sys.stderr)
    if as_json:
        print(json.dumps({**s, "exit_code": code}, default=str))
    return code
