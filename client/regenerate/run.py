"""Drive `hsx regenerate`: conversations fanned out over HsxClient's servers (its least-loaded
pick, retries, health probes, auth), each finished one journaled, then the output file.

Exit codes are `hsx extract`'s: 0 complete; 1 failed conversations (or stopped on an
error: rerun to resume, finished ones are kept); 2 refused before any work (usage, no
usable rows, sampling settings the server refuses at the pre-flight, plan mismatch, locked,
an endpoint without token ids); 130 interrupted.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hsx.exit_codes import ExitCode
from hsx import __version__ as hsx_version
from hsx_client import AuthenticationError, BadRequestError, ClientSettings, HsxClient, HsxError
from hsx_client.corpus import images
from hsx_client.corpus.rows import BadRow

from .conversations import Conversation, read_conversations
from .journal import Journal
from .mix import describe
from .turns import ContextFull, NoTokenIds, Sampling, regenerate, reply_of, request_body



@dataclass
class RegenConfig:
    client: ClientSettings  # the connection, passed whole (servers, key, limits)
    inputs: list[str]
    output: Path
    sampling: Sampling
    shard: tuple[int, int] | None = None  # (index, count): conversation j goes to shard j % count
    max_conversations: int | None = None
    quiet: bool = False
    transport: Any = None  # an httpx transport, for tests (as hsx extract's)


@dataclass
class RegenResult:
    exit_code: int
    summary: dict[str, Any] = field(default_factory=dict)


def plan_of(cfg: RegenConfig, conversations: list[Conversation]) -> dict[str, Any]:
    s = cfg.sampling
    return {
        "inputs": cfg.inputs,
        "keys": [c.key for c in conversations],
        "sampling": {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
                     "chat_template_kwargs": s.chat_template_kwargs, "model": s.model,
                     "stop_at_length": s.stop_at_length,
                     **({"mix": describe(s.mix)} if s.mix else {})},  # (a plan without a mix stays as it was)
        "shard": list(cfg.shard) if cfg.shard else None,
    }


def select(conversations: list[Conversation], cfg: RegenConfig) -> list[Conversation]:
    if cfg.shard is not None:
        i, n = cfg.shard
        conversations = [c for j, c in enumerate(conversations) if j % n == i]
    if cfg.max_conversations is not None:
        conversations = conversations[: cfg.max_conversations]
    return conversations


async def run_regenerate(cfg: RegenConfig) -> RegenResult:
    bad: list[BadRow] = []
    try:
        conversations = select(read_conversations(cfg.inputs, bad), cfg)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        return RegenResult(ExitCode.REFUSED, {"error": str(exc)})
    if not conversations:
        reasons = Counter(b.kind for b in bad)
        return RegenResult(ExitCode.REFUSED, {"error": f"no usable conversation in the inputs (bad rows: {dict(reasons)})",
                                          "bad_rows": len(bad)})
    refusal = await preflight(cfg, with_images=sum(c.has_images for c in conversations))
    if refusal is not None:  # before any work: no plan written, nothing locked
        return RegenResult(ExitCode.REFUSED, {"error": refusal})
    journal = Journal(cfg.output)
    try:
        journal.open(plan_of(cfg, conversations))
    except Exception as exc:  # locked, plan mismatch, not writable
        journal.close()
        return RegenResult(ExitCode.REFUSED, {"error": str(exc)})
    try:
        return await _run(cfg, conversations, journal, bad)
    finally:
        journal.close()


PREFLIGHT_CHAT = [{"role": "user", "content": "Hello"}]
# A 64x64 blue PNG: the run's image chats are asked once with it before any work.
PREFLIGHT_IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAEAAAABACAIAAAAlC+aJAAAAUUlEQVR42u3PMQ0AMAgAMJgaJCIRWVPBQdI6a"
                   "FZPXPbiOAEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAYF9HxuAAehvRUd1AAAAAElFTkSuQmCC")
PREFLIGHT_IMAGE_CHAT = [{"role": "user", "content": [images.image_part(PREFLIGHT_IMAGE),
                                                     {"type": "text", "text": "What colour is this?"}]}]


async def complete_with_images(client: HsxClient, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion; the plan's `file://` images read into data URIs first (off the
    event loop), as `hsx extract` sends them (hsx_client.corpus.images)."""
    if images.needs_inlining(body):
        body = await asyncio.to_thread(images.inline, body)
    return await client.chat_completion(body, request_id=None)


async def preflight(cfg: RegenConfig, with_images: int = 0) -> str | None:
    """One tiny generation (max_tokens 1) with each of the run's settings (its --mix
    variants' too) before any work: the line that refuses the run when the server rejects
    them (a 400/422: e.g. --seed on vLLM's CPU backend) or answers without token ids; None
    when they pass, or when the server could not be asked (the run then fails as it would).
    With image chats among the conversations (`with_images` of them), one with a small image
    too: a server that takes no images refuses the run there, not each conversation."""
    settings = [cfg.sampling] if not cfg.sampling.mix else [
        cfg.sampling.for_variant(v) for v in cfg.sampling.mix]
    client = HsxClient.from_settings(cfg.client, transport=cfg.transport)
    async with client:
        no_room = await _max_tokens_past_context(client, settings)
        if no_room is not None:
            return no_room
        for sampling in settings:
            body = request_body(PREFLIGHT_CHAT, None, replace(sampling, max_tokens=1),
                                sampling.conversation_seed("preflight"), 0)
            try:
                answer = await client.chat_completion(body, request_id=None)
                reply_of(answer)
            except NoTokenIds as exc:
                return str(exc)
            except AuthenticationError as exc:
                return f"the server refuses this run's API key: {exc.message}"
            except BadRequestError as exc:
                what = f" ({sampling.describe()})" if sampling.describe() else ""
                return (f"the server refuses this run's sampling settings{what}: {exc.message}; "
                        "nothing was generated or locked: rerun with other settings")
            except HsxError:
                return None
        if with_images:
            return await _image_preflight(client, settings[0], with_images)
    return None


async def _image_preflight(client: HsxClient, sampling: Sampling, count: int) -> str | None:
    body = request_body(PREFLIGHT_IMAGE_CHAT, None, replace(sampling, max_tokens=1),
                        sampling.conversation_seed("preflight"), 0)
    try:
        reply_of(await client.chat_completion(body, request_id=None))
    except BadRequestError as exc:
        return (f"the server refuses image chats ({count} of the conversations have images): {exc.message}; "
                "nothing was generated or locked: serve a model that takes images on a server whose "
                "/v1/chat/completions does, or leave those rows out")
    except HsxError:
        return None
    return None


async def _max_tokens_past_context(client: HsxClient, settings: list[Sampling]) -> str | None:
    """The line refusing a max_tokens that leaves no room for any prompt in the server's
    context (every conversation would be dropped, the run would store nothing); None when
    each fits, or when the server does not list a max_model_len."""
    largest = max((s.max_tokens for s in settings if s.max_tokens is not None), default=None)
    if largest is None:
        return None
    try:
        lengths = [m.get("max_model_len") for m in (await client.models()).get("data", [])]
    except (HsxError, AttributeError):
        return None
    context = min((n for n in lengths if isinstance(n, int)), default=None)
    if context is None or largest < context:
        return None
    return (f"--max-tokens {largest} leaves no room for a prompt in the server's context of {context} tokens "
            f"(max_model_len): every conversation would be dropped; give --max-tokens below {context}, or leave "
            "it out (each turn then gets the room left); nothing was generated or locked")


@dataclass
class _Tally:
    """What one run did, for its summary: the conversations stored and how they ended, the
    failures by reason with an example of each."""

    failures: Counter[str] = field(default_factory=Counter)
    errors: dict[str, str] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> its first conversation's key and message
    stats: dict[str, Any] = field(default_factory=lambda: {
        "conversations": 0, "generated_tokens": 0, "turns": 0, "length_cut_turns": 0, "dropped": 0,
        "ended": Counter(), "variants": Counter()})

    def failed(self, key: str, exc: BaseException) -> None:
        reason = images.MISSING_IMAGE if isinstance(exc, images.ImageFileError) else exc.type or type(exc).__name__
        self.failures[reason] += 1
        self.errors.setdefault(key, str(exc))
        self.examples.setdefault(reason, f"{key}: {getattr(exc, 'message', exc)}")

    def stored(self, out: Any, variant: Any) -> None:
        stats = self.stats
        if variant is not None:
            stats["variants"][variant.name] += 1
        stats["conversations"] += 1
        stats["turns"] += len(out.turns)
        stats["generated_tokens"] += out.generated_tokens
        stats["length_cut_turns"] += sum(t["finish_reason"] == "length" for t in out.turns)
        stats["ended"][out.ended] += 1

    def failure_fields(self) -> dict[str, Any]:
        return {"failed": sum(self.failures.values()), "failed_by_reason": dict(self.failures),
                "failed_examples": dict(list(self.errors.items())[:5]),
                "failed_example_by_reason": self.examples}


async def _run(cfg: RegenConfig, conversations: list[Conversation], journal: Journal,
               bad: list[BadRow]) -> RegenResult:
    todo = [c for c in conversations if c.key not in journal.done]
    tally = _Tally()
    refused: list[BaseException] = []
    started = time.monotonic()
    bar = _progress_bar(len(todo)) if not cfg.quiet and todo else None
    client = HsxClient.from_settings(cfg.client, transport=cfg.transport)
    info = await _server_info(client)
    slots = asyncio.Semaphore(cfg.client.concurrency_per_server * len(client.servers))

    async def one(conv: Conversation) -> None:
        async with slots:
            if refused:
                return
            sampling, variant = cfg.sampling.for_conversation(conv.key)
            try:
                out = await regenerate(conv.key, conv.messages, conv.tools, sampling,
                                       lambda body: complete_with_images(client, body))
            except NoTokenIds as exc:
                refused.append(exc)
                return
            except ContextFull:
                journal.record(conv.key, None)  # dropped for good: a rerun does not try it again
                tally.stats["dropped"] += 1
                return
            except (HsxError, images.ImageFileError) as exc:
                tally.failed(conv.key, exc)
                return
            journal.record(conv.key, conversation_row(cfg, conv, out, sampling, variant))
            tally.stored(out, variant)
            if bar is not None:
                rate = tally.stats["generated_tokens"] / max(1e-9, time.monotonic() - started)
                bar.set_postfix_str(f"gen {rate:,.0f} tok/s, failed {sum(tally.failures.values())}", refresh=False)
                bar.update(1)

    interrupted = False
    try:
        async with client:
            await asyncio.gather(*(one(c) for c in todo))
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.monotonic() - started
    keys = [c.key for c in conversations]
    manifest = output_manifest(cfg, conversations, journal, info)
    if not interrupted:
        manifest = journal.write_output(keys, manifest)
    dropped = [k for k in keys if k in journal.done and journal.done[k] is None]  # journaled as None
    stats = tally.stats
    summary = {
        "output": str(cfg.output),
        "planned": len(keys),
        "done_before": len(keys) - len(todo),  # conversations earlier runs finished, dropped ones included
        "regenerated": stats["conversations"],
        "turns": stats["turns"],
        "generated_tokens": stats["generated_tokens"],
        "generated_tokens_per_s": stats["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
        "length_cut_turns": stats["length_cut_turns"],
        "ended": dict(stats["ended"]),
        **({"variants": dict(stats["variants"])} if cfg.sampling.mix else {}),
        # the whole output, earlier runs' rows included: what the file holds once written
        "in_output": output_counts(keys, journal.done),
        "output_written": not interrupted,
        "dropped_context_full": len(dropped),  # this run's and earlier runs'
        "dropped_this_run": stats["dropped"],
        "dropped_examples": dropped[:3],
        **tally.failure_fields(),
        "bad_rows": len(bad),
        "bad_rows_by_kind": dict(Counter(b.kind for b in bad)),
        "elapsed_s": elapsed,
        "complete": manifest["complete"],
    }
    if refused:
        summary["error"] = str(refused[0])
        return RegenResult(ExitCode.REFUSED, summary)
    return RegenResult(ExitCode.INTERRUPTED if interrupted else ExitCode.OK if manifest["complete"] else ExitCode.FAILED,
                       summary)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="conv", desc="regenerate", dynamic_ncols=True, smoothing=0.05)


def conversation_row(cfg: RegenConfig, conv: Conversation, out: Any, sampling: Sampling, variant: Any) -> dict:
    """The output row of one regenerated conversation (`out`: turns.Regenerated)."""
    row: dict[str, Any] = {"messages": out.messages}
    if conv.tools:
        row["tools"] = conv.tools
    row["hsx_turns"] = out.turns
    row["hsx_regenerated"] = {"key": conv.key, "source": conv.source, "ended": out.ended,
                              "seed": cfg.sampling.conversation_seed(conv.key)}
    if variant is not None:
        row["hsx_regenerated"]["variant"] = variant.name
        row["hsx_regenerated"]["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                              "max_tokens": sampling.max_tokens,
                                              "chat_template_kwargs": sampling.chat_template_kwargs}
    return row


def output_manifest(cfg: RegenConfig, conversations: list[Conversation], journal: Journal,
                    info: dict[str, Any]) -> dict[str, Any]:
    """The output's manifest (how it was made), before `Journal.write_output` adds its size."""
    keys = [c.key for c in conversations]
    return {
        "what": "hsx regenerate",
        "inputs": cfg.inputs,
        "sampling": plan_of(cfg, conversations)["sampling"],
        "model": info.get("model"),
        "model_revision": info.get("model_revision"),
        "vllm_version": info.get("vllm_version"),
        "hsx_version": hsx_version,
        "server_hsx_version": info.get("hsx_version"),
        "planned": len(keys),
        "complete": all(k in journal.done for k in keys),
    }


def output_counts(keys: list[str], done: dict[str, Any]) -> dict[str, int]:
    """Rows, turns, generated tokens and turns cut by --max-tokens of the output (the journal's
    rows in plan order, as `Journal.write_output` writes them)."""
    rows = [done[k] for k in keys if done.get(k) is not None]
    turns = [t for r in rows for t in r.get("hsx_turns", [])]
    return {"rows": len(rows), "turns": len(turns), "generated_tokens": sum(len(t["token_ids"]) for t in turns),
            "length_cut_turns": sum(t.get("finish_reason") == "length" for t in turns)}


async def _server_info(client: HsxClient) -> dict[str, Any]:
    """hsx serve's /info (model, revision, versions) for the provenance; another
    OpenAI-compatible server has none: its /v1/models names the model."""
    try:
        return await client.info()
    except HsxError:
        pass
    try:
        models = await client.models()
        return {"model": (models.get("data") or [{}])[0].get("id")}
    except HsxError:
        return {}
