"""Issue 40, without an engine: which route `hsx regenerate --extract-to` takes (one pass
against hsx serve with prefix caching; two passes against vllm serve, a server with prefix
caching off, or --two-pass), how a one-pass sample becomes its regenerated ids, a journaled
conversation never regenerated again (resume), and the server affinity that keeps a
conversation's states request on the server that generated it. The engine test is
test_regenerate_one_pass_engine.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hsx_client import HsxClient, HsxError
from hsx_client.corpus.run import NO_SUPERVISED
from hsx_client.regenerate.cli import ONE_PASS, TWO_PASS, choose_route
from hsx_client.regenerate.conversations import Conversation
from hsx_client.regenerate.journal import Journal
from hsx_client.regenerate.one_pass import OnePass
from hsx_client.regenerate.run import RegenConfig
from hsx_client.regenerate.turns import Sampling
from hsx_client.servers import AFFINITY
from hsx_client.settings import ClientSettings

A, B = "http://a:1", "http://b:1"


def endpoint(info: dict | None, seen: list[tuple[str, str]] | None = None):
    def handle(request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}:{request.url.port}"
        if seen is not None:
            seen.append((host, request.url.path))
        if request.url.path == "/info":
            if info is None:  # vllm serve: no such route
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json=info)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        n = len(body["messages"])
        return httpx.Response(200, json={"prompt_token_ids": list(range(1, 2 * n + 1)), "choices": [{
            "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop", "token_ids": [7, 8]}]})
    return handle


def config(tmp_path, handler, servers=(A,)) -> RegenConfig:
    return RegenConfig(client=ClientSettings.given(list(servers), max_attempts=1), inputs=[],
                       output=tmp_path / "out.jsonl", sampling=Sampling(), quiet=True,
                       transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("info, two_pass, route, says", [
    ({"model": "m", "regeneration": {"one_pass": True}}, False, ONE_PASS, "one prefill"),
    ({"model": "m", "regeneration": {"one_pass": True}}, True, TWO_PASS, "--two-pass"),
    ({"model": "m", "regeneration": {"one_pass": False, "prefix_caching": False}}, False, TWO_PASS,
     "prefix caching is off"),
    ({"model": "m"}, False, TWO_PASS, "without one-pass capture"),  # an older hsx serve
    (None, False, TWO_PASS, "no hsx /info"),  # vllm serve
])
def test_route(tmp_path, info, two_pass, route, says):
    got, why = asyncio.run(choose_route(config(tmp_path, endpoint(info)), two_pass))
    assert got == route and says in why


def one_pass(tmp_path, conversations, handler, servers=(A,)):
    cfg = config(tmp_path, handler, servers)
    journal = Journal(cfg.output)
    journal.open({"keys": [c.key for c in conversations]})
    return cfg, journal, OnePass(cfg, conversations, journal, shuffle=False, seed=None)


TWO_TURNS = Conversation("c.jsonl:1", "c.jsonl:1", [
    {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}])
PROMPT_ONLY = Conversation("c.jsonl:2", "c.jsonl:2", [{"role": "user", "content": "q"}])


def test_samples_adjacent_per_conversation_and_their_ids(tmp_path):
    seen: list[tuple[str, str]] = []
    cfg, journal, one = one_pass(tmp_path, [TWO_TURNS, PROMPT_ONLY], endpoint({}, seen))
    keys = [s.key for s in one.read_samples([], mask_policy="per_turn")]
    assert keys == ["c.jsonl:1:t1", "c.jsonl:1:t2", "c.jsonl:2:t1"]

    async def go():
        async with HsxClient.from_settings(cfg.client, transport=cfg.transport) as client:
            bodies = await asyncio.gather(*(one.body_for(client, {"id": k, "messages": [], "layers": [1]})
                                            for k in keys))
            with pytest.raises(HsxError) as dropped:
                await one.body_for(client, {"id": "c.jsonl:2:t2"})  # a turn the regeneration never made
            return bodies, dropped.value
    bodies, dropped = asyncio.run(go())
    journal.close()
    assert dropped.type == NO_SUPERVISED
    assert len([p for _, p in seen if p == "/v1/chat/completions"]) == 3  # once per conversation turn, not per sample
    first, second = bodies[0][0], bodies[1][0]
    assert "messages" not in first and first["layers"] == [1]
    assert first["input_ids"] == [1, 2, 7, 8] and first["loss_mask"] == [0, 0, 1, 1]
    assert second["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8] and second["loss_mask"] == [0] * 6 + [1, 1]
    assert bodies[0][1] == A


def test_all_turns_sample_and_a_journaled_conversation_is_not_regenerated(tmp_path):
    seen: list[tuple[str, str]] = []
    cfg, journal, one = one_pass(tmp_path, [TWO_TURNS], endpoint({}, seen))
    journal.record(TWO_TURNS.key, {"messages": [], "hsx_turns": [
        {"prompt_token_ids": [1, 2], "token_ids": [7, 8], "finish_reason": "stop"},
        {"prompt_token_ids": [1, 2, 7, 8, 3], "token_ids": [9], "finish_reason": "stop"}]})
    assert [s.key for s in one.read_samples([], mask_policy="all_turns")] == ["c.jsonl:1:all"]

    async def go():
        async with HsxClient.from_settings(cfg.client, transport=cfg.transport) as client:
            return await one.body_for(client, {"id": "c.jsonl:1:all"})
    body, server = asyncio.run(go())
    journal.close()
    assert seen == []  # resumed from the journal: nothing generated again
    assert body["input_ids"] == [1, 2, 7, 8, 3, 9] and body["loss_mask"] == [0, 0, 1, 1, 0, 1]
    assert server is None


def test_affinity_sends_requests_to_the_chosen_server(tmp_path):
    seen: list[tuple[str, str]] = []
    cfg = config(tmp_path, endpoint({}, seen), servers=(A, B))

    async def go():
        async with HsxClient.from_settings(cfg.client, transport=cfg.transport) as client:
            token = AFFINITY.set(B)
            try:
                for _ in range(4):
                    await client.chat_completion({"messages": [{"role": "user", "content": "x"}]})
            finally:
                AFFINITY.reset(token)
    asyncio.run(go())
    assert {host for host, path in seen if path == "/v1/chat/completions"} == {B}


def test_the_corpus_plan_reads_the_conversations_not_the_output_written_at_the_end(tmp_path, monkeypatch):
    """The regenerate output does not exist when the corpus plan is made and is written at
    the end: recorded as the plan's input, a rerun of the finished command found it "new"
    and refused to resume. The plan records the conversations file instead."""
    from dataclasses import make_dataclass

    from hsx_client.corpus.extract import ExtractResult
    from hsx_client.regenerate import one_pass as module

    chats = tmp_path / "chats.jsonl"
    chats.write_text("{}\n")
    seen = {}

    class Recording:
        def __init__(self, xcfg, one, **kw):
            seen["inputs"], seen["shuffle"], seen["workers"] = xcfg.inputs, xcfg.shuffle, xcfg.workers

        async def run(self):
            return ExtractResult(0, "complete", {})

    monkeypatch.setattr(module, "OnePassExtractor", Recording)
    cfg, journal, _ = one_pass(tmp_path, [TWO_TURNS], endpoint({}))
    cfg.inputs = ["chats.jsonl"]
    monkeypatch.chdir(tmp_path)
    xcfg = make_dataclass("X", ["inputs", "shuffle", "seed", "workers", "quiet"])([str(cfg.output)], None, None, 4, True)
    asyncio.run(module.extract_in_one_pass(cfg, xcfg, [TWO_TURNS], journal))
    journal.close()
    assert seen == {"inputs": [str(chats)], "shuffle": False, "workers": 1}
