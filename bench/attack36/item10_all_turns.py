"""Issue 36.10 rerun: `--mask-policy all_turns` (requests with assistant_mask "all") supervises
every assistant turn's reply and its end-of-turn marker, on qwen3.jinja (no {% generation %})
as on its generation twin; earlier turns' <|im_end|> were unsupervised.

    hsx serve stories260K --chat-template llama3.jinja --trust-request-chat-template &
    python bench/attack36/item10_all_turns.py --url http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json

import httpx

from common import CHAT, STORIES, TEMPLATES, load
from record import record

THINK = "<think>\n\n</think>\n\n"


def supervised_runs(ids: list[int], mask: list[int], decode) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(decode(cur)), cur.clear()
    if cur:
        runs.append(decode(cur))
    return runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--chats", type=int, default=30)
    args = p.parse_args()
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(str(STORIES)).decode
    chats = [json.loads(line)["messages"] for line in (CHAT / "oasst" / "threads.messages.jsonl").open()]
    chats = [c for c in chats if sum(m["role"] == "assistant" for m in c) >= 2]
    before = load()
    turns = ended = twin_alike = too_long = 0
    misses = []
    with httpx.Client(timeout=120) as client:
        def runs(messages, template):
            r = client.post(args.url + "/tokenize", json={"messages": messages, "assistant_mask": "all",
                                                            "chat_template": (TEMPLATES / template).read_text()})
            if r.status_code == 413:  # past the server's token limit (511 on stories260K)
                return None
            r.raise_for_status()
            return supervised_runs(r.json()["token_ids"], r.json()["loss_mask"], decode)

        used = []
        for messages in chats:
            if len(used) == args.chats:
                break
            plain, twin = runs(messages, "qwen3.jinja"), runs(messages, "qwen3_training.jinja")
            if plain is None or twin is None:
                too_long += 1
                continue
            used.append(messages)
            n = sum(m["role"] == "assistant" for m in messages)
            turns += n
            ended += sum(r.rstrip().endswith("<|im_end|>") for r in plain)
            alike = [a.strip().removeprefix(THINK.strip()).strip() for a in plain] == \
                    [b.strip().removeprefix(THINK.strip()).strip() for b in twin]
            twin_alike += alike
            if len(plain) != n or not alike:
                misses.append({"turns": n, "runs": len(plain), "twin_runs": len(twin),
                               "ends": [r[-30:] for r in plain]})
    chats = used
    figures = {"chats": len(chats), "skipped_past_token_limit": too_long, "assistant_turns": turns, "turns_ending_supervised_im_end": ended,
               "chats_alike_with_generation_twin": twin_alike, "misses": misses[:3],
               "holds": ended == turns and twin_alike == len(chats), "load": max(before, load())}
    record("10", figures)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
