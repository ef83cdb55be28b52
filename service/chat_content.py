"""Message `content` given as a list of OpenAI parts (`[{"type": "text", "text": ...}]`),
rendered the way the chat template expects it.

A template either prints `message['content']` as a string or iterates over its parts. Handing
a list to a string template prints the list's Python repr (`[{'type': 'text', ...}]`), silently
wrong states and mask. So, as vLLM's own chat route does, the template's source is inspected
once: for a string template the text parts are joined with "\\n" (vLLM's join), for a parts
template a list stays a list of text parts (string contents stay strings for both). A part hsx
cannot render (an image, audio, anything but text) is refused by its position and type, never
stringified.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Literal

import jinja2
from jinja2 import nodes

from hsx_service.core.errors import BadInput

ContentFormat = Literal["string", "parts"]
_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")
TEXT_PART_TYPES = ("text", "input_text")  # the Chat Completions and the Responses API names


@lru_cache(maxsize=64)
def content_format(template: str) -> ContentFormat:
    """"parts" when the template loops over a message's content (`for x in message['content']`,
    also through a variable set from it), else "string"."""
    # transformers' {% generation %} tags (no jinja2 extension here) do not change how content is read
    template = _GENERATION_TAG.sub("", template)
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateError:
        return "string"  # rendering reports the template's own error
    content_vars: set[str] = set()  # names assigned from a message's content
    for assign in ast.find_all(nodes.Assign):
        if _is_content_access(assign.node, content_vars) and isinstance(assign.target, nodes.Name):
            content_vars.add(assign.target.name)
    for loop in ast.find_all(nodes.For):
        if _is_content_access(loop.iter, content_vars):
            return "parts"
    return "string"


def _is_content_access(node: nodes.Node, content_vars: set[str]) -> bool:
    """`X['content']`, `X.content`, or a name set from one of them (filters like `|list` seen through)."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Name) and node.name in content_vars


# An image (video) part once the server has loaded it (service/media/chat_media.py): what a
# parts template renders as the model's image (video) placeholder. Clients send `image_url`
# (`video_url`) parts.
IMAGE_PLACEHOLDER = {"type": "image"}
VIDEO_PLACEHOLDER = {"type": "video"}
PLACEHOLDERS = (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)


def normalize_messages(messages: list[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages with every list `content` made what a template of `fmt` renders right.
    Messages without a list content are returned as they are (the same objects)."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            if fmt == "parts" and any(p in content for p in PLACEHOLDERS):
                msg = {**msg, "content": _parts_with_images(content, i)}
            else:
                texts = text_parts(content, i)
                msg = {**msg, "content": "\n".join(texts) if fmt == "string" else
                       [{"type": "text", "text": t} for t in texts]}
        out.append(msg)
    return out


def _parts_with_images(content: list[Any], index: int) -> list[dict[str, Any]]:
    """A parts list keeping the loaded media's placeholders in place among its text parts."""
    out = []
    for j, part in enumerate(content):
        if part in PLACEHOLDERS:
            out.append(dict(part))
        else:
            out += [{"type": "text", "text": t} for t in text_parts([part], index, offset=j)]
    return out


def text_parts(content: list[Any], index: int, offset: int = 0) -> list[str]:
    """The texts of a content-part list, or BadInput naming the first part hsx cannot render
    (`offset`: the list's first part's index in the message)."""
    texts = []
    for j, part in enumerate(content, offset):
        if isinstance(part, str):  # some datasets write bare strings in the list
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        if kind in TEXT_PART_TYPES:
            raise BadInput(f"messages[{index}].content[{j}]: a {kind!r} part needs a string 'text'")
        if part in PLACEHOLDERS:  # loaded, but the template iterates no parts
            raise BadInput(f"messages[{index}].content[{j}]: this chat template renders no {kind}s (it prints "
                           "each message's content as a string)")
        raise BadInput(f"messages[{index}].content[{j}]: content parts of type {kind!r} are not supported "
                       f"(here text parts only: image_url parts go to /hidden_states and /tokenize of a model that "
                       f"takes images)")
    return texts


def reply_text(content: Any) -> str | None:
    """An assistant message's text as the mask's content search looks for it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return None
