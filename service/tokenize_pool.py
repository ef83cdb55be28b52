"""Chat templating and tokenization in a small pool of processes (pebble's ProcessPool).

A chat template is a program: a hostile or unlucky one loops for hours or allocates
gigabytes, and a thread cannot be stopped. So templating and tokenizing run in worker
processes that can be:
- stopped: each task has a deadline (`--tokenize-timeout`); pebble kills the worker that
  overruns it and starts a fresh one (the request gets 400);
- bounded: each worker may allocate at most `--tokenize-memory` beyond what the loaded
  tokenizer takes (RLIMIT_DATA; the request that needs more gets 413);
- refused: at most `--tokenize-workers` + `--tokenize-queue` requests are in the pool at
  once; one more gets 503 + Retry-After at once (`hsx_rejected_total{reason="tokenize"}`).
- shared fairly: a request reaches a process only when one is free for it, the next going to
  the client holding the fewest (tokenize_slots.py), so one client's requests never make
  another's wait behind all of them;
- bounded: a request that must fit a token limit (`most`) stops tokenizing once past it
  (tokenize.Tokenizer.past), so a text far too long costs a few times the limit to refuse.
- replaced: a worker whose input hit --tokenize-memory exits at once (the request gets
  413) and a fresh one takes its place, so the memory it took is given back now.
`input_ids` requests never come here, so they never wait behind templating. Request-
supplied chat templates (--trust-request-chat-template) run in a lane of their own
(--template-workers processes, --tokenize-queue waiting), so prompts and chats with the
server's template never wait behind them. Each worker loads the tokenizer once, at start.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import resource
import signal
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessExpired, ProcessPool

from hsx import lifeline

from hsx_service.core.errors import BadInput, Overloaded, ServiceError, TooLarge
from hsx_service.tokenize import Encoded, Tokenizer
from hsx_service.tokenize_slots import FairSlots, LaneFull

log = logging.getLogger("hsx.tokenize")
# The forkserver preloads this module (_context): it dies with hsx serve at once, not after
# its own slow exit (in the server itself this holds the lifeline of its owner, if any).
lifeline.hold()

_TOKENIZER: Tokenizer | None = None  # in each worker process
EXIT_MEMORY = 75  # a worker's exit status after its input hit --tokenize-memory
MEMORY_MESSAGE = ("templating or tokenizing this input needs more memory than the server's --tokenize-memory "
                  "allows; send a smaller input")


def _init_worker(name: str, revision: str | None, trust_remote_code: bool, template: str | None,
                 memory: int) -> None:
    global _TOKENIZER
    lifeline.hold()  # dies with hsx serve, however that one ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C drains the server; the pool stops with it
    _TOKENIZER = Tokenizer(name, revision, trust_remote_code, template)
    # RLIMIT_DATA (Linux >= 4.7: heap and private writable mappings), not RLIMIT_AS: the
    # address space also holds reservations (malloc's per-thread arenas, libraries) that
    # use no memory and grow with the core count.
    loaded = _data_bytes()
    resource.setrlimit(resource.RLIMIT_DATA, (loaded + memory, loaded + memory))


def _data_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _encode(kind: str, args: tuple, most: int | None) -> Encoded:
    assert _TOKENIZER is not None
    try:
        if kind == "prompt":
            return _TOKENIZER.encode_prompt(*args, most=most)
        if kind == "generation":
            return _TOKENIZER.encode_generation_prompt(*args, most=most)
        return _TOKENIZER.encode_chat(*args, most=most)
    except MemoryError:
        # Exit rather than answer: the memory the input took may stay with this process
        # (the allocator keeps it), so a fresh worker replaces it now; the pool sees the
        # exit status and answers 413.
        os._exit(EXIT_MEMORY)
    except ServiceError:
        raise
    except Exception as exc:  # e.g. text the tokenizer cannot take (lone surrogates)
        raise BadInput(f"could not tokenize the input: {exc}") from None


def _ping() -> str | None:
    assert _TOKENIZER is not None
    return _TOKENIZER.template_sha256


def _context():
    """forkserver: never fork the server itself (it runs vLLM's threads), and a worker
    that replaces a killed one forks from a process that has transformers imported
    already (seconds sooner than a fresh interpreter)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hsx_service.tokenize_pool", "transformers.models.auto.tokenization_auto"])
    return ctx


class _Lane:
    """One process pool and the places and turns of the requests in it."""

    def __init__(self, name: str, workers: int, queue: int, initargs: tuple) -> None:
        self.name = name
        self.slots = FairSlots(workers, workers + queue)
        self.pool = ProcessPool(max_workers=workers, initializer=_init_worker, initargs=initargs, context=_context())


class TokenizerPool:
    def __init__(self, name: str, revision: str | None, trust_remote_code: bool, template: str | None, *,
                 workers: int, queue: int, timeout: float, memory: int, request_template_workers: int = 0) -> None:
        self.timeout = timeout
        self.template_sha256: str | None = None  # of the server's chat template, once ready
        initargs = (name, revision, trust_remote_code, template, memory)
        self._main = _Lane("tokenized", workers, queue, initargs)
        # Request-supplied templates: their own processes (none: they are refused before here).
        self._request_templates = (_Lane("rendering request chat templates", request_template_workers, queue, initargs)
                                   if request_template_workers else None)

    @property
    def busy(self) -> int:
        return self._main.slots.busy + (self._request_templates.slots.busy if self._request_templates else 0)

    async def ready(self) -> None:
        """Wait until a worker has loaded the tokenizer (raises what its start raised)."""
        self.template_sha256 = await asyncio.wrap_future(self._main.pool.schedule(_ping))
        if self._request_templates is not None:
            await asyncio.wrap_future(self._request_templates.pool.schedule(_ping))

    async def encode(self, kind: str, *args: Any, client: str = "", long: bool = False,
                     most: int | None = None) -> Encoded:
        """kind "prompt": (text, add_special_tokens, keep_first); "chat": (messages, tools,
        template, which, template_kwargs); "generation": (messages, tools, template,
        template_kwargs). `client`: who sends it (a fair share of the processes); `long`: a
        text past what the token limit could hold uncut (never on the last free process);
        `most`: the tokens it may have (beyond, tokenizing stops: Encoded.complete is False).
        Raises ServiceError (Overloaded when its lane has no place for it)."""
        lane = self._main
        if kind in ("chat", "generation") and args[2] is not None and self._request_templates is not None:
            lane = self._request_templates
        try:
            async with lane.slots.hold(client, long):
                return await self._run(lane, kind, args, most)
        except LaneFull as exc:
            raise Overloaded(f"no place for this request among those being {lane.name}: {exc}; retry shortly",
                             reason="tokenize") from None

    async def _run(self, lane: _Lane, kind: str, args: tuple, most: int | None) -> Encoded:
        """One request on a process of `lane` (its turn has come: one is free for it)."""
        try:
            future = lane.pool.schedule(_encode, args=(kind, args, most), timeout=self.timeout)
            return await asyncio.wrap_future(future)  # cancelling it stops the worker
        except FutureTimeout:
            raise BadInput(f"templating and tokenizing this input took longer than the server's "
                           f"--tokenize-timeout of {self.timeout:g}s; send a smaller input") from None
        except ProcessExpired as exc:
            if exc.exitcode == EXIT_MEMORY:
                raise TooLarge(MEMORY_MESSAGE) from None
            raise TooLarge(f"the tokenizer process died on this input ({exc}); send a smaller input") from None

    def close(self) -> None:
        """Stop the workers now (running tasks included) and wait for them."""
        lanes = [lane for lane in (self._main, self._request_templates) if lane is not None]
        for lane in lanes:
            lane.pool.stop()
        for lane in lanes:
            lane.pool.join(timeout=5)
