"""Issue 36.0: `content` as a list of OpenAI parts renders exactly as the equivalent string
for string templates (every fixture template and the tiny models' own), as parts for
templates that iterate them, and a part hsx cannot render is refused by name. Through a real
server: tests/service/test_service_correctness.py (/tokenize, /hidden_states)."""

from __future__ import annotations

import json

import pytest

from _server import CHAT, STORIES, TEMPLATES
from hsx_service.chat_content import content_format, normalize_messages
from hsx_service.core.errors import BadInput
from hsx_service.tokenize import Tokenizer
from hsx_tools.tiny_model import CHAT_TEMPLATE as TINY_TEMPLATE

PARTS_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]"
    "{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    if not STORIES.exists():
        pytest.skip(f"shared fixtures not found at {STORIES}")
    return Tokenizer(str(STORIES), None, False, None)


def templates() -> list[tuple[str, str]]:
    out = [("tiny_model", TINY_TEMPLATE)]
    if TEMPLATES.exists():
        out += [(p.name, p.read_text()) for p in sorted(TEMPLATES.glob("*.jinja"))]
    return out


def oasst_chats(n: int = 6) -> list[list[dict]]:
    path = CHAT / "oasst" / "threads.messages.jsonl"
    if not path.exists():
        pytest.skip(f"shared fixtures not found at {path}")
    return [json.loads(line)["messages"] for line in path.open()][:n]


def as_parts(messages: list[dict]) -> list[dict]:
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]


@pytest.mark.parametrize("name,template", templates(), ids=[n for n, _ in templates()])
def test_text_parts_render_as_the_string_content_on_every_template(tok, name, template):
    assert content_format(template) == "string", name
    for chat in oasst_chats():
        whole = tok.encode_chat(chat, None, template, "all")
        parts = tok.encode_chat(as_parts(chat), None, template, "all")
        assert parts.token_ids == whole.token_ids and parts.loss_mask == whole.loss_mask, name
        assert "'type'" not in tok.tok.decode(parts.token_ids), "a list was printed as Python text"
        prompt = chat[:-1]
        gen = tok.encode_generation_prompt(prompt, None, template, None)
        assert tok.encode_generation_prompt(as_parts(prompt), None, template, None).token_ids == gen.token_ids


def test_several_text_parts_join_with_a_newline_as_vllm_does(tok):
    template = (TEMPLATES / "llama3.jinja").read_text() if TEMPLATES.exists() else TINY_TEMPLATE
    split = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Hi!"}]
    a, b = tok.encode_chat(split, None, template, "all"), tok.encode_chat(joined, None, template, "all")
    assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask


def test_a_template_that_iterates_parts_gets_parts(tok):
    assert content_format(PARTS_TEMPLATE) == "parts"
    chat = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "you"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hi there"}]}]
    text = tok.tok.decode(tok.encode_chat(chat, None, PARTS_TEMPLATE, "all").token_ids)
    assert "[Hello][you]" in text.replace(" ", "") and "[Hithere]" in text.replace(" ", "")
    enc = tok.encode_chat(chat, None, PARTS_TEMPLATE, "all")
    supervised = tok.tok.decode([t for t, m in zip(enc.token_ids, enc.loss_mask) if m])
    assert "Hi" in supervised and "Hello" not in supervised


def test_content_read_through_a_variable_counts_as_iterating():
    via_set = ("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}{% endfor %}"
               "{% endfor %}")
    assert content_format(via_set) == "parts"
    assert content_format("{{ messages[0]['content'] }}") == "string"
    assert content_format("{% for x in %}") == "string"  # broken: rendering reports it


@pytest.mark.parametrize("part,words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, ["messages[0].content[1]", "'image_url'"]),
    ({"type": "input_audio", "input_audio": {"data": "AAAA"}}, ["messages[0].content[1]", "'input_audio'"]),
    ({"type": "text", "text": 7}, ["messages[0].content[1]", "string 'text'"]),
    (["nested"], ["messages[0].content[1]", "'list'"]),
])
def test_a_part_that_cannot_be_rendered_is_refused_by_name(tok, part, words):
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]},
            {"role": "assistant", "content": "A cat."}]
    for fmt in ("string", "parts"):
        with pytest.raises(BadInput) as e:
            normalize_messages(chat, fmt)
        assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(BadInput):
        tok.encode_chat(chat, None, TINY_TEMPLATE, "all")


def test_string_contents_are_left_alone():
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    out = normalize_messages(chat, "parts")
    assert out[0] is chat[0] and out[1] is chat[1]
