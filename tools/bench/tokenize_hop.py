"""What the tokenizer processes cost a typical chat: templating + tokenizing + mask in
the server's process (the old way, on a thread) vs through the pool (tokenize_pool.py),
same process, same chats. `python -m hsx_tools.bench.tokenize_hop [MODEL TEMPLATE CHATS.jsonl]`
(defaults: the shared stories260K, llama3.jinja, the OASST threads)."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"


async def _main(model: str, template: str, chats: list[list[dict]]) -> None:
    from hsx_service.tokenize import Tokenizer
    from hsx_service.tokenize_pool import TokenizerPool

    tok = Tokenizer(model, None, False, template)
    pool = TokenizerPool(model, None, False, template, workers=2, queue=8, timeout=30, memory=1 << 30)
    await pool.ready()
    try:
        for chat in chats[:20]:  # warm both
            tok.encode_chat(chat, None, None, "all")
            await pool.encode("chat", chat, None, None, "all")
        local, hop = [], []
        for chat in chats:
            t = time.perf_counter()
            a = await asyncio.to_thread(tok.encode_chat, chat, None, None, "all")
            local.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = await pool.encode("chat", chat, None, None, "all")
            hop.append(time.perf_counter() - t)
            assert a == b
        ml, mh = statistics.median(local), statistics.median(hop)
        print(f"{len(chats)} chats: median in-process (thread) {ml * 1000:.2f} ms, through the pool {mh * 1000:.2f} ms, "
              f"overhead {(mh - ml) * 1000:.2f} ms a chat (ratio {mh / ml:.2f})")
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    model = argv[0] if argv else str(SHARED / "models" / "stories260K")
    template = Path(argv[1] if len(argv) > 1 else SHARED / "chat_templates" / "llama3.jinja").read_text()
    path = Path(argv[2] if len(argv) > 2 else SHARED / "chat" / "oasst" / "threads.messages.jsonl")
    chats = [json.loads(line)["messages"] for line in path.open()]
    asyncio.run(_main(model, template, chats))


if __name__ == "__main__":
    main()
