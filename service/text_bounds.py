"""The bounds on the text one request asks the tokenizer processes to work on, the same for
every route that takes text (/hidden_states, /tokenize, /v1/chat/completions).

- `--max-messages`: a chat with more messages is refused (413, `check_message_count`).
- `--max-text-bytes` (default 64 x the token limit, at least 4 MiB): more text is refused
  (413) before any templating or tokenizing. The floor leaves room for long documents cut by
  truncation; a text that must fit the token limit whole is refused by tokenizing only a
  bounded prefix of it (tokenize.Tokenizer.past), however long it is.
- A text past what the token limit is expected to hold uncut (`is_long`) is tokenized on at most all
  but one of the tokenizer processes (tokenize_slots.py), so one is left to texts that fit.
"""

from __future__ import annotations

import json
from typing import Any

from hsx_service.core.errors import TooLarge

TEXT_BYTES_PER_TOKEN = 64  # more than any tokenizer's text per token: a generous bound
MIN_TEXT_BYTES = 4 << 20
# Twice a tokenizer's usual text per token (3 to 5 bytes of English, code or chat): a text
# past this many bytes a token is not expected to fit uncut.
LONG_BYTES_PER_TOKEN = 8


def default_max_text_bytes(max_tokens: int) -> int:
    return max(MIN_TEXT_BYTES, TEXT_BYTES_PER_TOKEN * max_tokens)


def text_bytes(req: Any) -> int:
    """The text a request asks the server to template and tokenize, in UTF-8 bytes (a
    /hidden_states or /tokenize body, or a chat completion's)."""
    prompt = getattr(req, "prompt", None)
    if prompt is not None:
        return len(prompt.encode("utf-8", "surrogatepass"))
    tools, kwargs = getattr(req, "tools", None), getattr(req, "chat_template_kwargs", None)
    total = len(getattr(req, "chat_template", None) or "") + (len(json.dumps(tools)) if tools else 0)
    total += len(json.dumps(kwargs)) if kwargs else 0
    for m in getattr(req, "messages", None) or ():
        c = m.content
        total += len(c.encode("utf-8", "surrogatepass")) if isinstance(c, str) else len(json.dumps(c)) if c else 0
        total += len(json.dumps(m.model_extra)) if m.model_extra else 0
    return total


def check_text_bytes(req: Any, max_text_bytes: int) -> int:
    """The request's text bytes; raises TooLarge past `max_text_bytes`."""
    size = text_bytes(req)
    if size > max_text_bytes:
        raise TooLarge(f"{size} bytes of text; this server takes at most {max_text_bytes} bytes a request "
                       "(--max-text-bytes): send a shorter input")
    return size


def check_message_count(messages: list | None, max_messages: int) -> None:
    """Raises TooLarge for a chat over `--max-messages`. A size limit like the body's, the
    tokens' and the text's, so the same 413 on every route (a 400 would say the request is
    malformed; it is only too big, and the same chat in fewer messages passes)."""
    if messages is not None and len(messages) > max_messages:
        raise TooLarge(f"{len(messages)} messages; this server takes at most {max_messages} (--max-messages)")


def is_long(size: int, max_tokens: int) -> bool:
    """Text past what `max_tokens` hold at LONG_BYTES_PER_TOKEN: not expected to fit uncut."""
    return size > LONG_BYTES_PER_TOKEN * max_tokens
