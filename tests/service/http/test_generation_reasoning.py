"""hsx serve --reasoning-parser: vLLM's own parsers split a reply into reasoning_content
and content as `vllm serve` does (no engine: the parser on a vocabulary holding the
think tokens; stories260K has none, so the engine tests cannot show it)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from hsx_service.core.errors import StartupError  # noqa: E402
from hsx_service.http.routes_generation import ChatCompletionRequest, ReasoningSplitter  # noqa: E402

pytestmark = pytest.mark.slow  # imports vLLM's parsers


class Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


BODY = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_reasoning_is_split_by_vllms_parser(name):
    splitter = ReasoningSplitter(name, Vocab({"<think>": 5, "</think>": 6}))
    assert splitter.split("<think>\nLet me see.\n</think>\n\nIt is 4.", BODY) == ("\nLet me see.\n", "\n\nIt is 4.")


def test_a_model_without_think_tokens_is_refused_at_start():
    with pytest.raises(StartupError, match="deepseek_r1"):
        ReasoningSplitter("deepseek_r1", Vocab({"a": 1}))
    with pytest.raises(StartupError, match="no-such-parser"):
        ReasoningSplitter("no-such-parser", Vocab({}))
