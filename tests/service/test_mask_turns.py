"""Issue 36.10: `--mask-policy all_turns` (assistant_mask "all") supervised the last turn's
end-of-turn tokens but not earlier turns' on qwen3.jinja (the template renders a chat's last
turn with a thinking block and earlier ones without, so the per-turn method's span of an
earlier turn is no prefix of the chat and fell back to the bare reply). One rule for every
turn: a reply and the template's end-of-turn marker after it, as the `{% generation %}` twin
of the template marks it. On the shared fixture templates, without an engine."""

from __future__ import annotations

import json

import pytest

from _server import CHAT, STORIES, TEMPLATES
from hsx_service.tokenize import PER_TURN_LIMIT, Tokenizer, assistant_spans

END = {"llama3": "<|eot_id|>", "qwen2_5": "<|im_end|>\n", "qwen3": "<|im_end|>\n"}
THINK = "<think>\n\n</think>\n\n"  # what qwen3 (last turn) and its twin (every turn) put before a reply


@pytest.fixture(scope="module")
def tok():
    if not STORIES.exists():
        pytest.skip(f"shared fixtures not found at {STORIES}")
    return Tokenizer(str(STORIES), None, False, None)


def _multi_turn(n: int = 30) -> list[list[dict]]:
    chats = [json.loads(line)["messages"] for line in (CHAT / "oasst" / "threads.messages.jsonl").open()]
    return [c for c in chats if sum(m["role"] == "assistant" for m in c) >= 2][:n]


def _turn_texts(tok, messages: list[dict], template: str) -> list[str]:
    text = (TEMPLATES / template).read_text()

    def render(msgs, gen):
        return tok.tok.apply_chat_template(msgs, chat_template=text, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    return [full[a:b] for a, b in assistant_spans(messages, full, render)]


@pytest.mark.parametrize("template", ["llama3.jinja", "llama3_training.jinja", "qwen2_5.jinja",
                                      "qwen2_5_training.jinja", "qwen3.jinja", "qwen3_training.jinja"])
def test_every_assistant_turn_ends_with_its_end_of_turn_marker_supervised(tok, template):
    marker = END[template.split("_training")[0].removesuffix(".jinja")]
    for messages in _multi_turn():
        texts = _turn_texts(tok, messages, template)
        assert len(texts) == sum(m["role"] == "assistant" for m in messages)
        assert all(t.endswith(marker) for t in texts), [t[-40:] for t in texts]


def test_qwen3_and_its_generation_twin_supervise_each_turn_alike(tok):
    """The twin writes a thinking block before every reply, qwen3 before the last only:
    past that block, each turn's supervised text is the same."""
    for messages in _multi_turn():
        plain = [t.removeprefix(THINK) for t in _turn_texts(tok, messages, "qwen3.jinja")]
        twin = [t.removeprefix(THINK) for t in _turn_texts(tok, messages, "qwen3_training.jinja")]
        assert plain == twin


@pytest.mark.parametrize("template", ["llama3_training.jinja", "qwen3_training.jinja"])
def test_the_mask_of_a_generation_template_equals_transformers_own(tok, template):
    """On a `{% generation %}` template hsx's all-turns mask is exactly the one transformers
    derives from the tags (return_assistant_tokens_mask)."""
    text = (TEMPLATES / template).read_text()
    for messages in _multi_turn(10):
        enc = tok.encode_chat(messages, None, text, "all")
        hf = tok.tok.apply_chat_template(messages, chat_template=text, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        assert enc.token_ids == hf["input_ids"] and enc.loss_mask == hf["assistant_masks"]


def test_past_the_per_turn_limit_every_turn_still_ends_supervised(tok):
    """Long chats take the content search (a bounded number of renderings): same rule."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
                for i in range(2 * (PER_TURN_LIMIT + 6))]
    texts = _turn_texts(tok, messages, "qwen3.jinja")
    assert len(texts) == PER_TURN_LIMIT + 6 and all(t.endswith(END["qwen3"]) for t in texts)
