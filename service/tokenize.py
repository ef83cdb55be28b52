"""Text and chat to token ids, and the assistant-token loss mask.

The mask comes from the rendered text, so it works with any chat template:
- templates with `{% generation %}` markers: transformers' own assistant mask;
- others: each assistant turn's character span is the text between the chat
  rendered up to that turn with the generation prompt and the chat rendered
  through that turn (so the span holds the reply and its end-of-turn marker). When
  a template re-renders earlier turns differently (e.g. drops reasoning), the
  span falls back to the reply's content found in the full text.
Tokens whose first character lies in a span are supervised.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from hsx_service.errors import BadInput


@dataclass
class Encoded:
    token_ids: list[int]
    loss_mask: list[int] | None
    mask_source: str  # "request", "chat_template", "none"


class Tokenizer:
    def __init__(self, name: str, revision: str | None, trust_remote_code: bool, chat_template: str | None):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
        self.default_template = chat_template or getattr(self.tok, "chat_template", None)

    @property
    def template_sha256(self) -> str | None:
        if not self.default_template:
            return None
        return hashlib.sha256(self.default_template.encode()).hexdigest()

    def encode_prompt(self, text: str, add_special_tokens: bool) -> Encoded:
        ids = self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return Encoded(list(ids), None, "none")

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        template: str | None,
        which: str,
    ) -> Encoded:
        template = template or self.default_template
        if not template:
            raise BadInput(
                "this model has no chat template: start the server with --chat-template FILE "
                "or send chat_template with the request"
            )
        if not any(m.get("role") == "assistant" for m in messages):
            raise BadInput("messages hold no assistant turn, so there is nothing to supervise")

        def render(msgs: list[dict[str, Any]], gen_prompt: bool) -> str:
            try:
                return self.tok.apply_chat_template(
                    msgs, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=gen_prompt
                )
            except Exception as exc:  # jinja errors, raise_exception() in templates
                raise BadInput(f"the chat template failed to render these messages: {exc}") from exc

        full = render(messages, False)
        spans = self._assistant_spans(messages, full, render)
        if which == "last":
            spans = spans[-1:]
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            if end > start and any(s <= start < e for s, e in spans):
                mask[t] = 1
        return Encoded(ids, mask, "chat_template")

    @staticmethod
    def _assistant_spans(messages: list[dict[str, Any]], full: str, render) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, msg in enumerate(messages):
            if msg.get("role") != "assistant":
                continue
            before = render(messages[:i], True)
            through = render(messages[: i + 1], False)
            if full.startswith(before) and full.startswith(through) and len(through) > len(before):
                start, end = len(before), len(through)
            else:
                content = msg.get("content") or ""
                if not isinstance(content, str) or not content:
                    continue
                start = full.find(content, cursor)
                if start < 0:
                    continue
                end = start + len(content)
            spans.append((start, end))
            cursor = end
        return spans
