"""hsx regenerate without an engine: the turn-by-turn logic against a fake completion
endpoint, the journal's torn tail, extract's token-exact reading of a regenerated row,
reasoning fields of every input format, and Qwen3's real reasoning template behind
chat_template_kwargs (shared/fixtures/chat_templates/qwen3.jinja: the model's original
template, as shipped with TRL, Apache-2.0, LICENSE.trl beside it)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hsx_client.corpus.inputs import BadRow, read_samples
from hsx_client.regenerate.conversations import read_conversations
from hsx_client.regenerate.journal import Journal
from hsx_client.errors import BadRequestError
from hsx_client.regenerate.turns import ContextFull, NoTokenIds, Sampling, regenerate
from _server import STORIES, TEMPLATES


class FakeServer:
    """Answers like /v1/chat/completions: prompt ids = one id per message, reply k."""

    def __init__(self, tool_calls=None, finish="stop", token_ids=True):
        self.bodies: list[dict] = []
        self.tool_calls = tool_calls
        self.finish = finish
        self.token_ids = token_ids

    async def __call__(self, body):
        self.bodies.append(body)
        k = len(self.bodies)
        msg = {"role": "assistant", "content": f"reply {k}", "reasoning_content": f"think {k}"}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        choice = {"message": msg, "finish_reason": self.finish}
        out = {"choices": [choice]}
        if self.token_ids:
            choice["token_ids"] = [100 + k, 2]
            out["prompt_token_ids"] = list(range(len(body["messages"]) + 1))
        return out


def run(messages, server, tools=None, **sampling):
    return asyncio.run(regenerate("f:1", messages, tools, Sampling(**sampling), server))


def test_each_turn_answers_the_models_own_earlier_replies():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "old 1", "extra": "dropped"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "old 2"}]
    server = FakeServer()
    out = run(msgs, server, seed=5, temperature=0.7)
    assert [m["content"] for m in out.messages] == ["s", "u1", "reply 1", "u2", "reply 2"]
    assert out.messages[2]["reasoning_content"] == "think 1"
    assert server.bodies[1]["messages"][2] == out.messages[2]  # the model's own reply, not the recorded one
    assert "extra" not in json.dumps(server.bodies)
    seeds = [b["seed"] for b in server.bodies]
    assert seeds[1] == seeds[0] + 1 and all(b["return_token_ids"] for b in server.bodies)
    assert [t["token_ids"] for t in out.turns] == [[101, 2], [102, 2]] and out.ended == "complete"


def test_user_turns_without_replies_get_one_each():
    """MT-Bench questions and prompt rows: user turns only."""
    out = run([{"role": "user", "content": "q1"}, {"role": "user", "content": "q2"}], FakeServer())
    assert [m["role"] for m in out.messages] == ["user", "assistant", "user", "assistant"]


def test_a_length_cut_turn_is_flagged_and_stops_only_when_asked():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert len(run(msgs, FakeServer(finish="length")).turns) == 2
    cut = run(msgs, FakeServer(finish="length"), stop_at_length=True)
    assert len(cut.turns) == 1 and cut.ended == "length" and cut.turns[0]["finish_reason"] == "length"


def test_tool_calls_pair_by_function_or_end_the_conversation():
    call = [{"id": "rec-1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "tool_call_id": "rec-1", "content": "sunny"}, {"role": "assistant", "content": "ok"}]
    same = [{"id": "gen-9", "type": "function", "function": {"name": "get_weather", "arguments": "{\"c\": 1}"}}]
    out = run(msgs, FakeServer(tool_calls=same))
    assert out.messages[1]["tool_calls"][0]["id"] == "rec-1" and out.messages[2]["content"] == "sunny"
    other = [{"id": "gen-9", "type": "function", "function": {"name": "search", "arguments": "{}"}}]
    ended = run(msgs, FakeServer(tool_calls=other))
    assert ended.ended == "unpaired_tool_calls" and len(ended.messages) == 2
    text_only = run(msgs, FakeServer())  # no structured calls at all (ShareGPT function_call)
    assert text_only.ended == "unpaired_tool_calls"


def test_an_endpoint_without_token_ids_is_refused():
    with pytest.raises(NoTokenIds, match="never re-tokenizes"):
        run([{"role": "user", "content": "a"}], FakeServer(token_ids=False))


class ContextLimit(FakeServer):
    """Refuses, as hsx serve does, a prompt of more than `limit` messages."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    async def __call__(self, body):
        if len(body["messages"]) > self.limit:
            raise BadRequestError("max_tokens 8 + the prompt's 600 tokens exceed max_model_len 512", status=400)
        return await super().__call__(body)


def test_a_turn_with_no_room_in_the_context_ends_the_conversation_or_drops_it():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    out = run(msgs, ContextLimit(2))
    assert out.ended == "context_full" and [m["role"] for m in out.messages] == ["user", "assistant"]
    with pytest.raises(ContextFull):
        run(msgs, ContextLimit(0))
    with pytest.raises(BadRequestError):  # any other refusal is the conversation's failure
        run(msgs, type("Refusing", (FakeServer,), {"__call__": _refuse})())


async def _refuse(self, body):
    raise BadRequestError("model 'x' is not served here", status=400)


def test_journal_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "o.jsonl"
    j = Journal(out)
    j.open({"keys": ["a", "b"]})
    j.record("a", {"messages": []})
    j.close()
    with open(j.dir / "journal.jsonl", "ab") as fh:
        fh.write(b'{"key": "b", "ro')
    j = Journal(out)
    j.open({"keys": ["a", "b"]})
    assert list(j.done) == ["a"]
    j.record("b", {"messages": [1]})
    j.record("c", None)  # dropped: journaled, never written
    manifest = j.write_output(["a", "b", "c"], {})
    j.close()
    assert manifest["rows"] == 2 and [json.loads(x) for x in out.read_text().splitlines()][1] == {"messages": [1]}
    with pytest.raises(Exception, match="other settings"):
        Journal(out).open({"keys": ["a"]})


def test_extract_reads_recorded_ids_and_supervises_exactly_the_generated_ones(tmp_path):
    row = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                        {"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}],
           "hsx_turns": [{"prompt_token_ids": [1, 5, 6], "token_ids": [7, 8, 2]},
                         {"prompt_token_ids": [1, 5, 6, 7, 8, 2, 9], "token_ids": [10, 2]}]}
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(row) + "\n")
    per_turn = [s.request for s in read_samples([str(f)])]
    assert per_turn[1] == {"input_ids": [1, 5, 6, 7, 8, 2, 9, 10, 2], "loss_mask": [0] * 7 + [1, 1]}
    (whole,) = [s.request for s in read_samples([str(f)], mask_policy="all_turns")]
    assert whole["loss_mask"] == [0, 0, 0, 1, 1, 1, 0, 1, 1]
    f.write_text(json.dumps({**row, "hsx_turns": [{"prompt_token_ids": "1 2", "token_ids": []}]}) + "\n")
    bad: list[BadRow] = []
    assert read_samples([str(f)], bad_rows=bad) == [] and "hsx_turns" in bad[0].reason


def test_reasoning_fields_of_every_format_become_reasoning_content(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "t1"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "reasoning": "t2"}]},
        {"instruction": "q", "output": "a", "reasoning_content": "t3"},
    ]
    f = tmp_path / "mixed.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [s.request["messages"][-1]["reasoning_content"] for s in read_samples([str(f)])]
    assert got == ["t1", "t2", "t3"]
    convs = read_conversations([str(f)], [])
    assert convs[0].messages[-1]["reasoning_content"] == "t1"


@pytest.fixture(scope="module")
def qwen3():
    from conftest import need_fixtures

    need_fixtures()
    from hsx_service.tokenize import Tokenizer

    return Tokenizer(str(STORIES), None, False, (TEMPLATES / "qwen3.jinja").read_text())


@pytest.mark.slow  # loading a transformers tokenizer: seconds on a loaded 2-core box
def test_qwen3_template_takes_enable_thinking(qwen3):
    chat = [{"role": "user", "content": "Hi"}]
    on = qwen3.tok.decode(qwen3.encode_generation_prompt(chat, None, None, None).token_ids)
    off = qwen3.tok.decode(qwen3.encode_generation_prompt(chat, None, None, {"enable_thinking": False}).token_ids)
    assert "<think>" not in on.split("assistant")[-1] and off.rstrip().endswith("</think>")


@pytest.mark.slow
def test_qwen3_mask_supervises_the_last_turns_reasoning_and_drops_earlier_ones(qwen3):
    chat = [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Alpha", "reasoning_content": "Old"},
            {"role": "user", "content": "Two"}, {"role": "assistant", "content": "Beta", "reasoning_content": "New"}]
    enc = qwen3.encode_chat(chat, None, None, "last")
    text = qwen3.tok.decode(enc.token_ids)
    supervised = qwen3.tok.decode([t for t, m in zip(enc.token_ids, enc.loss_mask) if m])
    assert "Old" not in text  # the template drops earlier turns' thinking
    assert "New" in supervised and "Beta" in supervised and "Two" not in supervised
