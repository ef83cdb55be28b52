"""Text and chat to token ids, and the assistant-token loss mask (runs in the tokenizer
processes of tokenize_pool.py, never on the event loop).

The mask comes from the rendered text, so it works with any chat template. The
definition (the per-turn method): each assistant turn's character span runs from the end
of the chat rendered up to that turn with the generation prompt to the end of the chat
rendered through that turn (so the span holds the reply and its end-of-turn marker).
When a template re-renders earlier turns differently (e.g. drops reasoning), the span
falls back to the reply's content found in the full text, followed by the template's
end-of-turn marker (`end_of_turn`: what ends the last turn's span after its reply), so
every turn's end-of-turn tokens are supervised alike. Tokens whose first character lies in
a span are supervised.

Rendering twice per turn is quadratic in the chat's length (4096 messages: ~40 s), so
the spans come from a constant number of renderings (`_one_pass_spans`): the chat once
with every assistant reply replaced by a unique placeholder locates each reply in the
full text; the per-turn method run on the last assistant turn alone gives the text
between the generation prompt and the reply and the reply's end marker; every other turn
must show the same two strings around its reply. Any mismatch (a template whose turns
are not alike) falls back to the per-turn method, or, past PER_TURN_LIMIT assistant
turns, to the content search, so the cost stays bounded either way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from hsx_service.chat_content import content_format, normalize_messages, reply_text
from hsx_service.core.errors import BadInput

PER_TURN_LIMIT = 64  # assistant turns the quadratic per-turn fallback may take
PREFIX_CHARS_PER_TOKEN = 8  # first guess of the text a kept prefix of tokens needs


@dataclass
class Encoded:
    token_ids: list[int]
    loss_mask: list[int] | None
    mask_source: str  # "request", "chat_template", "none"
    # False: tokenizing stopped once past the caller's `most` tokens; token_ids are the first
    # most + 1 only (the caller refuses the input: it cannot fit).
    complete: bool = True
    # Chats with images or videos (service/media/chat_media.py): 1 for each image or video token (the model's
    # processor's expansion of its placeholders), and vLLM's processed prompt that holds them.
    media_mask: list[int] | None = None
    engine_input: Any = None


Span = tuple[int, int]


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

    # ---------------------------------------------------------------------- prompts
    def encode_prompt(self, text: str, add_special_tokens: bool, keep_first: int | None = None,
                      most: int | None = None) -> Encoded:
        """`keep_first`: only the first tokens matter (right truncation): tokenize a
        bounded prefix of the text instead of all of it (`prefix_ids`). `most`: see `past`."""
        if (over := self.past(text, add_special_tokens, most)) is not None:
            return over
        if keep_first is not None:
            ids = self.prefix_ids(text, add_special_tokens, keep_first)
            if ids is not None:
                return Encoded(ids, None, "none")
        ids = self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return Encoded(list(ids), None, "none")

    def prefix_ids(self, text: str, add_special_tokens: bool, keep: int) -> list[int] | None:
        """The first `keep` tokens of `text`'s full tokenization, from prefixes of it: a
        prefix's tokens near its cut may differ from the full text's (a word cut in two),
        so the first `keep` tokens are taken only once a prefix twice as long gives the
        same ones. None when the text is too short for that (tokenize it whole)."""
        chars = max(64, keep * PREFIX_CHARS_PER_TOKEN)
        shorter: list[int] | None = None
        while chars < len(text):
            ids = list(self.tok(text[:chars], add_special_tokens=add_special_tokens)["input_ids"])
            if len(ids) > keep:
                if shorter is not None and shorter[:keep] == ids[:keep]:
                    return ids[:keep]
                shorter = ids
            chars *= 2
        return None

    def past(self, text: str, add_special_tokens: bool, most: int | None) -> Encoded | None:
        """When `text` has more than `most` tokens, its first most + 1 (incomplete), found
        from a bounded prefix: an input that cannot fit the caller's limit costs a few
        times the limit's text to refuse, never its whole length. None when it fits (or
        `most` is None): tokenize it whole."""
        if most is None:
            return None
        ids = self.prefix_ids(text, add_special_tokens, most + 1)
        return Encoded(ids, None, "none", complete=False) if ids is not None else None

    # ------------------------------------------------------------------------ chats
    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        template: str | None,
        which: str,
        template_kwargs: dict[str, Any] | None = None,
        most: int | None = None,
    ) -> Encoded:
        """`most`: see `past` (checked on the rendered chat, before the mask's renderings)."""
        template = self._template(template)
        messages = normalize_messages(messages, content_format(template))
        if not any(m.get("role") == "assistant" for m in messages):
            raise BadInput("messages hold no assistant turn, so there is nothing to supervise")

        def render(msgs: list[dict[str, Any]], gen_prompt: bool) -> str:
            return self._render(msgs, tools, template, gen_prompt, template_kwargs)

        full = render(messages, False)
        if (over := self.past(full, False, most)) is not None:
            return over
        spans = assistant_spans(messages, full, render)
        if which == "last":
            spans = spans[-1:]
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        return Encoded(ids, mask_from_spans(enc["offset_mapping"], spans), "chat_template")


    def _template(self, template: str | None) -> str:
        template = template or self.default_template
        if not template:
            raise BadInput(
                "this model has no chat template: start the server with --chat-template FILE "
                "(or with --trust-request-chat-template, send chat_template with the request)"
            )
        return template

    def _render(self, msgs: list[dict[str, Any]], tools: list[dict] | None, template: str, gen_prompt: bool,
                template_kwargs: dict[str, Any] | None) -> str:
        try:
            return self.tok.apply_chat_template(
                msgs, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=gen_prompt,
                **(template_kwargs or {}),
            )
        except MemoryError:  # the worker's --tokenize-memory: the pool answers 413
            raise
        except Exception as exc:  # jinja errors, raise_exception() in templates
            raise BadInput(f"the chat template failed to render these messages: {exc}") from exc

    def encode_generation_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                                 template: str | None, template_kwargs: dict[str, Any] | None,
                                 most: int | None = None) -> Encoded:
        """The prompt of POST /v1/chat/completions: the chat with the generation prompt,
        tokenized without special tokens added (the template holds them), as vLLM's
        chat route does. `most`: see `past`."""
        template = self._template(template)
        messages = normalize_messages(messages, content_format(template))
        text = self._render(messages, tools, template, True, template_kwargs)
        if (over := self.past(text, False, most)) is not None:
            return over
        return Encoded(list(self.tok(text, add_special_tokens=False)["input_ids"]), None, "none")


def mask_from_spans(offsets, spans: list[Span]) -> list[int]:
    """1 for each token whose first character lies in a span (spans ascending): one walk."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        if end <= start:
            continue
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k < len(spans) and spans[k][0] <= start:
            mask[t] = 1
    return mask


def assistant_spans(messages: list[dict[str, Any]], full: str, render) -> list[Span]:
    spans = _one_pass_spans(messages, full, render)
    if spans is not None:
        return spans
    assistants = sum(1 for m in messages if m.get("role") == "assistant")
    if assistants <= PER_TURN_LIMIT:
        return per_turn_spans(messages, full, render)
    return _content_spans(messages, full, end_of_turn(messages, full, render))


def per_turn_spans(messages: list[dict[str, Any]], full: str, render) -> list[Span]:
    """The definition: two renderings per assistant turn (quadratic)."""
    spans: list[Span] = []
    cursor = 0
    marker: str | None = None
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        span = _turn_span(messages, i, full, render)
        if span is None:
            if marker is None:
                marker = end_of_turn(messages, full, render)
            span = _with_marker(_find_content(msg, full, cursor), full, marker)
            if span is None:
                continue
        spans.append(span)
        cursor = span[1]
    return spans


def end_of_turn(messages: list[dict[str, Any]], full: str, render) -> str:
    """The text the template writes after an assistant reply to end its turn (`<|im_end|>\n`,
    `<|eot_id|>`), as the per-turn method's span of the last assistant turn shows it; "" when
    that span cannot be found. A turn whose own span the template hides (Qwen3 renders a
    chat's last turn with a thinking block, earlier ones without, so a turn rendered as the
    last is no prefix of the whole chat) is supervised as its reply found in the text plus
    this marker: every turn ends supervised the same way, as in the template's `{% generation %}`
    twin."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        return ""
    last = _turn_span(messages, turns[-1], full, render)
    if last is None:
        return ""
    reply = _find_content(messages[turns[-1]], full, last[0])
    if reply is None or reply[1] > last[1]:
        return ""
    return full[reply[1]:last[1]]


def _with_marker(span: Span | None, full: str, marker: str) -> Span | None:
    """A reply's span with the end-of-turn marker that follows it (where it does)."""
    if span is None or not marker or not full.startswith(marker, span[1]):
        return span
    return span[0], span[1] + len(marker)


def _turn_span(messages, i: int, full: str, render) -> Span | None:
    before = render(messages[:i], True)
    through = render(messages[: i + 1], False)
    if full.startswith(before) and full.startswith(through) and len(through) > len(before):
        return len(before), len(through)
    return None


def _find_content(msg: dict[str, Any], full: str, cursor: int) -> Span | None:
    content = reply_text(msg.get("content"))
    if not content:
        return None
    for text in _rendered_forms(content):
        start = full.find(text, cursor)
        if start >= 0:
            return start, start + len(text)
    return None


def _rendered_forms(content: str) -> list[str]:
    """How a template may show a reply: as recorded, or, for a reply holding its thinking
    inline, the answer after the last `</think>` (DeepSeek-R1's and Qwen3's templates cut
    it there, and Qwen3's strips the newlines around it)."""
    forms = [content]
    if "</think>" in content:
        answer = content.split("</think>")[-1]
        forms += [a for a in (answer, answer.strip("\n")) if a and a not in forms]
    return forms


def _content_spans(messages, full: str, marker: str = "") -> list[Span]:
    spans, cursor = [], 0
    for msg in messages:
        if msg.get("role") == "assistant" and (span := _find_content(msg, full, cursor)) is not None:
            span = _with_marker(span, full, marker)
            spans.append(span)
            cursor = span[1]
    return spans


def _placeholder(k: int) -> str:
    return f"\ue000hsx{k}\ue001"  # private-use characters: in no real chat


def _one_pass_spans(messages: list[dict[str, Any]], full: str, render) -> list[Span] | None:
    """The per-turn method's spans from four renderings, or None where the template's
    assistant turns do not all look alike (see the module docstring)."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if any(not isinstance(messages[i].get("content"), str) for i in turns):
        return None
    if any(_placeholder(0)[0] in str(m.get("content")) for m in messages):
        return None
    marked = [dict(m) for m in messages]
    for k, i in enumerate(turns):
        marked[i]["content"] = _placeholder(k)
    replies = _locate_replies(render(marked, False), full, [messages[i]["content"] for i in turns])
    if replies is None:
        return None
    last = _turn_span(messages, turns[-1], full, render)
    if last is None:
        return None
    (cs, ce), (start, end) = replies[-1], last
    if not start <= cs <= ce <= end:
        return None
    head, tail = full[start:cs], full[ce:end]
    spans = []
    for cs, ce in replies:
        if full[cs - len(head):cs] != head or full[ce:ce + len(tail)] != tail or cs < len(head):
            return None
        spans.append((cs - len(head), ce + len(tail)))
    return spans


def _locate_replies(marked: str, full: str, replies: list[str]) -> list[Span] | None:
    """Where each reply lies in `full`, given the same chat rendered with placeholders
    for the replies: the text between placeholders must match `full` exactly and each
    reply appear as given or stripped (templates `trim` replies)."""
    spans: list[Span] = []
    pos = 0  # in full
    at = 0  # in marked
    for k, reply in enumerate(replies):
        mark = _placeholder(k)
        m = marked.find(mark, at)  # a placeholder rendered twice would leave one in the text
        if m < 0:  # compared with `full` below, which holds none: no match
            return None
        between = marked[at:m]
        if full[pos:pos + len(between)] != between:
            return None
        pos += len(between)
        at = m + len(mark)
        nxt = marked.find(_placeholder(k + 1), at) if k + 1 < len(replies) else len(marked)
        following = marked[at:nxt if nxt >= 0 else len(marked)]
        for form in dict.fromkeys((reply, reply.strip(), reply.lstrip(), reply.rstrip())):
            if full.startswith(form, pos) and full.startswith(following, pos + len(form)):
                spans.append((pos, pos + len(form)))
                pos += len(form)
                break
        else:
            return None
    if marked[at:] != full[pos:]:
        return None
    return spans
