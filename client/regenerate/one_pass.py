"""`hsx regenerate --extract-to DIR` in one generation pass.

What the engine already does: under hsx serve, vLLM's `extract_hidden_states` method
writes the captured layers' states of every token it forwards into the KV pages of a
cache-only layer, at the prefill and at every decode step alike. So when a generation
finishes, its pages hold the states of the prompt (prefix-cache hits of earlier turns
included: those pages were written when they were computed) and of every generated token
but the last sampled one, which was never forwarded. With prefix caching on, the full
pages stay in the prefix cache after the request ends.

How hsx reads them out: right after a conversation's generation, on the same server
(`hsx_client.servers.AFFINITY`), the client asks `POST /hidden_states` for the
conversation's token ids (the recorded prompt and generated ids, never re-tokenized).
Its prefill is a prefix-cache hit for every full page; the engine computes only the last
partial page (at most one block of tokens, the last token among them), and hsx's connector
copies all the request's pages, cached ones included, as for any /hidden_states request.
The cost is measured on /metrics: `hsx_engine_prompt_tokens_total` counts prompt tokens
the engine computed (cache hits left out), so the one-pass route adds at most a block per
sample to the generation's own count, where the two-pass route prefills everything again.

Why not a new field on /v1/chat/completions that returns the states with the answer: the
states would have to be reserved in the arena for prompt + max_tokens before the first
token, and the wire format, leases, chunked windows and the corpus writer would need a
second entry point. This route reuses all of them unchanged (the corpus is hsx extract's:
either format, any draft, crash-safe, resumable, `hsx verify`), at the price of one small
continuation prefill per sample. A page evicted between the generation and the states
request is simply recomputed: the states are right either way, only the cost shows it.

The driver: hsx extract's own loop (`Extractor`) over samples planned from the
conversations (keys `{conversation}:t{k}` per assistant turn, or `{conversation}:all`),
whose client (`OnePassClient`) turns each states request into "regenerate the
conversation once (shared by its samples, journaled in OUTPUT.hsx-regen/ like `hsx
regenerate`), then the states of its recorded ids". A conversation's samples stay adjacent
in the plan (shuffled by conversation, not by sample) so they are asked for while its
pages are cached. A resumed run takes journaled conversations from the journal; their
samples' prefill then hits the cache only if the pages are still there.

What differs from a fresh prefill: in fp32 on CPU nothing measurable (the engine test,
< 1e-4 relative at every layer); in bf16 on GPUs the generated tokens' states come from
decode steps (other kernels, batch shapes and accumulation order than a prefill), so they
differ from a prefill of the same ids by bf16 rounding: they are the states the target
really computes when it serves those tokens.

Servers that cannot do this (vllm serve: no /info; hsx serve with prefix caching off) get
the two-pass route: regenerate, then `hsx extract` of the output (cli.py says which).
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from hsx.exit_codes import ExitCode
from hsx_client import HsxClient, HsxError
from hsx_client.corpus.extract import Extractor, ExtractResult, default_hooks
from hsx_client.corpus.plan import normalize_input
from hsx_client.corpus.recorded import recorded_samples
from hsx_client.corpus.rows import RowProblem, Sample
from hsx_client.corpus.run import NO_SUPERVISED
from hsx_client.servers import AFFINITY

from .conversations import Conversation
from .journal import Journal
from .run import RegenConfig, conversation_row
from .turns import ContextFull, _reply_points, regenerate

CHAT_FIELDS = ("messages", "tools", "chat_template_kwargs", "assistant_mask", "chat_template", "prompt")
SERVERS_REMEMBERED = 4096  # conversations whose server is kept for their later samples


async def one_pass_refusal(client: HsxClient) -> str | None:
    """Why the servers cannot capture in one pass, or None when every one can."""
    infos = await client.server_infos()
    for url in client.servers:
        info = infos.get(url)
        if info is None:
            return f"{url} has no hsx /info (not hsx serve, or not reachable)"
        capture = info.get("regeneration") or {}
        if not capture.get("one_pass"):
            return f"{url} cannot keep generated states (prefix caching is off)" if "one_pass" in capture else \
                f"{url} runs an hsx serve without one-pass capture"
    return None


class OnePass:
    """The conversations, the regenerate journal, and each conversation's regeneration
    (one per conversation, awaited by all its samples)."""

    def __init__(self, cfg: RegenConfig, conversations: list[Conversation], journal: Journal,
                 shuffle: bool, seed: int | None) -> None:
        self.cfg = cfg
        self.by_key = {c.key: c for c in conversations}
        self.order = [c.key for c in conversations]
        if shuffle:
            random.Random(seed or 0).shuffle(self.order)
        self.journal = journal
        self.mask_policy = "per_turn"
        self._running: dict[str, asyncio.Future] = {}
        self._server_of: OrderedDict[str, str] = OrderedDict()
        self._load: dict[str, int] = {}
        self.generated_tokens = 0
        self.regenerated = 0
        self.dropped = 0

    def read_samples(self, paths: list[str], *, mask_policy: str = "per_turn", bad_rows: list | None = None,
                     max_samples: int | None = None) -> list[Sample]:
        """hsx extract's sample reader for this run: a conversation's samples adjacent. The
        request is the recorded conversation (what /tokenize sizes for the disk estimate);
        `OnePassClient` replaces it with the regenerated ids."""
        self.mask_policy = mask_policy
        out: list[Sample] = []
        for key in self.order:
            conv = self.by_key[key]
            request: dict[str, Any] = {"messages": conv.messages}
            if conv.tools:
                request["tools"] = conv.tools
            if mask_policy == "per_turn":
                n = max(1, len(_reply_points(conv.messages)))
                out += [Sample(f"{key}:t{k}", conv.source, request) for k in range(1, n + 1)]
            else:
                out.append(Sample(f"{key}:all", conv.source, request))
        return out[:max_samples] if max_samples is not None else out

    async def body_for(self, client: HsxClient, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The /hidden_states body of sample `body["id"]`: its regenerated ids and mask, and
        the server its conversation was generated on (None: unknown, e.g. journaled earlier)."""
        conv_key, _, part = str(body.get("id", "")).rpartition(":")
        if conv_key not in self.by_key:
            raise HsxError(f"sample {body.get('id')!r} is not one of this run's conversations", type="bad_request")
        row = await self._row(client, conv_key)
        ids, mask = self._sample_ids(row, part)
        new = {k: v for k, v in body.items() if k not in CHAT_FIELDS}
        new.update(input_ids=ids, loss_mask=mask)
        return new, self._server_of.get(conv_key)

    def _sample_ids(self, row: dict[str, Any] | None, part: str) -> tuple[list[int], list[int]]:
        turns = (row or {}).get("hsx_turns") or []
        try:
            if part == "all":
                request = recorded_samples("c", 0, "", turns, "all_turns")[0].request
                return request["input_ids"], request["loss_mask"]
            k = int(part.removeprefix("t"))
        except (RowProblem, ValueError):
            raise _dropped("the regenerated conversation has no generated tokens") from None
        if row is None or k > len(turns) or not turns[k - 1]["token_ids"]:
            raise _dropped(f"the regenerated conversation has no turn {k} (it ended earlier)")
        t = turns[k - 1]
        return t["prompt_token_ids"] + t["token_ids"], [0] * len(t["prompt_token_ids"]) + [1] * len(t["token_ids"])

    async def _row(self, client: HsxClient, key: str) -> dict[str, Any] | None:
        if key in self.journal.done:
            return self.journal.done[key]
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(self._regenerate(client, key))
            running.add_done_callback(lambda _f: self._running.pop(key, None))
        return await asyncio.shield(running)

    async def _regenerate(self, client: HsxClient, key: str) -> dict[str, Any] | None:
        conv = self.by_key[key]
        url = min(client.servers, key=lambda u: self._load.get(u, 0))
        self._load[url] = self._load.get(url, 0) + 1
        AFFINITY.set(url)  # this task's context only
        try:
            sampling, variant = self.cfg.sampling.for_conversation(key)
            try:
                out = await regenerate(key, conv.messages, conv.tools, sampling,
                                       lambda b: client.chat_completion(b, request_id=None))
            except ContextFull:
                self.journal.record(key, None)  # dropped for good, as `hsx regenerate` does
                self.dropped += 1
                return None
            row = conversation_row(self.cfg, conv, out, sampling, variant)
            self.journal.record(key, row)
            self.regenerated += 1
            self.generated_tokens += out.generated_tokens
            self._server_of[key] = url
            while len(self._server_of) > SERVERS_REMEMBERED:
                self._server_of.popitem(last=False)
            return row
        finally:
            self._load[url] -= 1


def _dropped(why: str) -> HsxError:
    return HsxError(f"dropped: {why}", type=NO_SUPERVISED)


class OnePassClient(HsxClient):
    """hsx extract's client whose states requests regenerate their conversation first and
    go to the server that generated it (the module docstring)."""

    one_pass: OnePass

    @asynccontextmanager
    async def _on_its_server(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The states body of the sample's regenerated conversation, sent (inside the block)
        to the server that generated it."""
        body, url = await self.one_pass.body_for(self, body)
        token = AFFINITY.set(url)
        try:
            yield body
        finally:
            AFFINITY.reset(token)

    async def hidden_states_response(self, body: dict[str, Any], **kw: Any) -> Any:
        async with self._on_its_server(body) as body:
            return await super().hidden_states_response(body, **kw)

    async def hidden_states_stream(self, body: dict[str, Any], **kw: Any) -> Any:
        async with self._on_its_server(body) as body:
            return await super().hidden_states_stream(body, **kw)

    async def tokenize(self, body: dict[str, Any], *, request_id: str | None = None) -> dict[str, Any]:
        if body.get("require_supervised"):  # a corpus sample (--states none), not a size estimate
            body, _ = await self.one_pass.body_for(self, body)
        return await super().tokenize(body, request_id=request_id)


class OnePassExtractor(Extractor):
    def __init__(self, cfg: Any, one_pass: OnePass, **kw: Any) -> None:
        hooks = replace(default_hooks(), read_samples=one_pass.read_samples)
        super().__init__(cfg, hooks, **kw)
        self.one_pass = one_pass

    def _client(self) -> HsxClient:
        client = OnePassClient.from_settings(self.cfg.client, transport=self.transport)
        client.one_pass = self.one_pass
        return client


async def extract_in_one_pass(cfg: RegenConfig, xcfg: Any, conversations: list[Conversation],
                              journal: Journal) -> tuple[ExtractResult, OnePass]:
    """hsx extract into `xcfg.output`, each sample's conversation regenerated when first asked."""
    one = OnePass(cfg, conversations, journal, shuffle=xcfg.shuffle is not False, seed=xcfg.seed)
    # The plan records the conversations as its input files: the regenerate output does not
    # exist yet when the plan is made (a rerun would find it "new" and refuse to resume).
    inputs = [normalize_input(str(x)) for x in cfg.inputs]
    # shuffled by conversation above; one process shares them
    xcfg = replace(xcfg, inputs=inputs, shuffle=False, workers=1)
    if xcfg.quiet is False and cfg.quiet:
        xcfg = replace(xcfg, quiet=True)
    result = await OnePassExtractor(xcfg, one, transport=cfg.transport).run()
    return result, one


async def run_one_pass(cfg: RegenConfig, xcfg: Any) -> tuple[int, dict[str, Any]]:
    """The whole one-pass run: (exit code, summary). The regenerate output (PATH) is written
    from the journal at the end, as `hsx regenerate` writes it; the corpus as samples finish."""
    from .run import _server_info, output_counts, output_manifest, preflight, read_conversations, select

    bad: list[Any] = []
    try:
        conversations = select(read_conversations(cfg.inputs, bad), cfg)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        return ExitCode.REFUSED, {"error": str(exc)}
    if not conversations:
        return ExitCode.REFUSED, {"error": "no usable conversation in the inputs", "bad_rows": len(bad)}
    refusal = await preflight(cfg)
    if refusal is not None:
        return ExitCode.REFUSED, {"error": refusal}
    from .run import plan_of

    journal = Journal(cfg.output)
    try:
        journal.open(plan_of(cfg, conversations))
    except Exception as exc:  # locked, plan mismatch, not writable
        journal.close()
        return ExitCode.REFUSED, {"error": str(exc)}
    try:
        result, one = await extract_in_one_pass(cfg, xcfg, conversations, journal)
        interrupted = result.exit_code == ExitCode.INTERRUPTED
        keys = [c.key for c in conversations]
        async with HsxClient.from_settings(cfg.client, transport=cfg.transport) as client:
            info = await _server_info(client)
        manifest = output_manifest(cfg, conversations, journal, info)
        if not interrupted:
            manifest = journal.write_output(keys, manifest)
        summary = {"route": "one-pass", "output": str(cfg.output), "planned": len(keys),
                   "regenerated": one.regenerated, "generated_tokens": one.generated_tokens,
                   "dropped_this_run": one.dropped, "in_output": output_counts(keys, journal.done),
                   "output_written": not interrupted, "complete": manifest["complete"],
                   "extract": {"status": result.status, "exit_code": result.exit_code, **result.summary}}
        code = result.exit_code if result.exit_code != ExitCode.OK or manifest["complete"] else ExitCode.FAILED
        return code, summary
    finally:
        journal.close()


__all__ = ["OnePass", "OnePassClient", "extract_in_one_pass", "one_pass_refusal", "run_one_pass"]
