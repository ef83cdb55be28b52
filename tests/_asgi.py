"""Small ASGI pieces shared by the in-process fake servers of the client tests."""

from __future__ import annotations


async def serve_lifespan(receive, send) -> None:
    """Acknowledge startup and shutdown until the server shuts down."""
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return


async def read_body(receive) -> bytes:
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body
