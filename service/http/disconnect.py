"""The one owner of the race between a request's work and its client leaving (as vLLM's
`with_cancellation`): the engine process's /hidden_states route and the HTTP workers'
relay and lease exchange all wait on it.

ASGI tells a handler that its client left only through `receive()` returning
`http.disconnect` (the body has been read by then), so a watcher reads it beside the
work; whichever finishes first decides, and the caller says what a departure means
(abort the engine request, ask the engine process to, or close the upstream connection).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]


async def client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (the request's body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_client(work: asyncio.Future, receive: Receive, *stops: Awaitable) -> asyncio.Future:
    """Wait until `work` is done, the client has left, or one of `stops` (e.g. the drain's
    cut-off) completes. Returns the client watcher, still running when the client is still
    there (a caller that goes on sending may keep watching; the others cancel it). `stops`
    are cancelled here; should this wait itself be cancelled, the work and the watcher are too."""
    gone = asyncio.ensure_future(client_gone(receive))
    watchers = [asyncio.ensure_future(s) for s in stops]
    try:
        await asyncio.wait({work, gone, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        gone.cancel()
        raise
    finally:
        for w in watchers:
            w.cancel()
    return gone
