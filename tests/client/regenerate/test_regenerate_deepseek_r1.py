"""DeepSeek-R1's real reasoning template (templates/deepseek_r1.jinja, MIT, LICENSE.deepseek_r1
beside it) through hsx regenerate and hsx extract, without an engine: the generation
prompts are rendered by hsx serve's own tokenizer code on stories260K's vocabulary, and a
fake generator answers in R1's style (its reply opens inside the `<think>` the prompt
ends with, closes it, then answers), split as vLLM's deepseek_r1 reasoning parser splits it.

What R1's template does, and so what hsx does with it:
  * the generation prompt ends with `<｜Assistant｜><think>\\n`: every reply starts thinking;
  * earlier replies are rendered from their `content` cut after the last `</think>`; the
    template never reads `reasoning_content`, so earlier turns' thinking is dropped from
    every later prompt, and a recorded (not regenerated) R1 chat supervises answers only;
  * a regenerated turn supervises exactly its generated ids: its thinking, `</think>`, the
    answer and the end-of-sentence token.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hsx_client.corpus.inputs import read_samples
from hsx_client.regenerate.conversations import read_conversations
from hsx_client.regenerate.turns import Sampling, regenerate
from _server import STORIES

R1 = Path(__file__).parent / "templates" / "deepseek_r1.jinja"
EOS = "<｜end▁of▁sentence｜>"

pytestmark = pytest.mark.slow  # a transformers tokenizer: seconds on a loaded 2-core box


@pytest.fixture(scope="module")
def r1():
    from conftest import need_fixtures

    need_fixtures()
    from hsx_service.tokenize import Tokenizer

    return Tokenizer(str(STORIES), None, False, R1.read_text())


class R1Generator:
    """/v1/chat/completions in R1's style on the real template: the prompt ids are the
    rendered generation prompt's, the reply thinks, closes </think>, answers."""

    def __init__(self, tok):
        self.tok = tok
        self.prompts: list[str] = []

    async def __call__(self, body):
        enc = self.tok.encode_generation_prompt(body["messages"], body.get("tools"), None,
                                                body.get("chat_template_kwargs"))
        self.prompts.append(self.tok.tok.decode(enc.token_ids))
        k = len(self.prompts)
        reasoning, answer = f"hmm number {k} is odd", f"Answer {k}."
        ids = self.tok.tok(f"{reasoning}\n</think>\n\n{answer}{EOS}", add_special_tokens=False)["input_ids"]
        message = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        return {"prompt_token_ids": enc.token_ids,
                "choices": [{"message": message, "token_ids": ids, "finish_reason": "stop"}]}


def test_generation_prompt_opens_the_thinking(r1):
    text = r1.tok.decode(r1.encode_generation_prompt([{"role": "user", "content": "Hi"}], None, None, None).token_ids)
    assert text.endswith("<｜User｜>Hi<｜Assistant｜><think>\n")


def test_regenerated_r1_turns_drop_earlier_thinking_and_supervise_exactly_the_generated_ids(r1, tmp_path):
    chat = [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "old"}]
    gen = R1Generator(r1)
    out = asyncio.run(regenerate("c:1", chat, None, Sampling(seed=1), gen))
    assert [t["finish_reason"] for t in out.turns] == ["stop", "stop"]
    first, second = out.messages[1], out.messages[3]
    assert (first["content"], first["reasoning_content"]) == ("Answer 1.", "hmm number 1 is odd")
    # the second prompt: the model's own first answer, its thinking dropped as the template does
    assert "<｜Assistant｜>Answer 1." in gen.prompts[1] and "number 1" not in gen.prompts[1]
    assert gen.prompts[1].endswith("<｜User｜>Two?<｜Assistant｜><think>\n")

    f = tmp_path / "regen.jsonl"
    f.write_text(json.dumps({"messages": out.messages, "hsx_turns": out.turns}) + "\n")
    samples = read_samples([str(f)])
    assert len(samples) == 2
    for sample, turn in zip(samples, out.turns):
        ids, mask = sample.request["input_ids"], sample.request["loss_mask"]
        assert ids == turn["prompt_token_ids"] + turn["token_ids"]
        assert [t for t, m in zip(ids, mask) if m] == turn["token_ids"]
    supervised = r1.tok.decode(out.turns[1]["token_ids"])
    assert supervised.startswith("hmm number 2 is odd\n</think>\n\nAnswer 2.<｜end")  # (▁ decodes as a space)
    # reasoning_content read back from the regenerated file, as hsx extract's readers see it
    (conv,) = read_conversations([str(f)], [])
    assert [m.get("reasoning_content") for m in conv.messages if m["role"] == "assistant"] == [
        "hmm number 1 is odd", "hmm number 2 is odd"]


def test_a_recorded_r1_chat_supervises_answers_only(r1):
    """The template cuts every reply at its last </think>, the last reply's included, and
    never reads reasoning_content: recorded thinking is not in the rendered chat at all.
    (A reply with inline thinking was unsupervised before the mask looked for the answer
    after </think>: its recorded content is not in the rendered text.)"""
    chat = [{"role": "user", "content": "One"},
            {"role": "assistant", "content": "<think>Old</think>Alpha"},
            {"role": "user", "content": "Two"},
            {"role": "assistant", "content": "Beta", "reasoning_content": "New"}]
    enc = r1.encode_chat(chat, None, None, "all")
    text = r1.tok.decode(enc.token_ids)
    supervised = r1.tok.decode([t for t, m in zip(enc.token_ids, enc.loss_mask) if m])
    assert "Old" not in text and "New" not in text
    assert "Alpha" in supervised and "Beta" in supervised and "Two" not in supervised
    # the thinking held inline is cut by the template: the answer after </think> is still found
    first = r1.encode_chat(chat[:2], None, None, "last")
    assert r1.tok.decode([t for t, m in zip(first.token_ids, first.loss_mask) if m]).strip() == "Alpha"
