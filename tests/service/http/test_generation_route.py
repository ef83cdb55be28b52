"""POST /v1/chat/completions on hsx serve's embedded engine, and chat_template_kwargs on
/hidden_states: against the session-shared stories260K server (no engine of its own)."""

from __future__ import annotations

import httpx
import pytest
import torch

from hsx.wire import decode

pytestmark = pytest.mark.engine

CHAT = [{"role": "user", "content": "Tell me a story about a dog."}]


def complete(server, **body):
    return httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, **body}, timeout=120)


def test_generation_returns_text_ids_usage_and_is_greedy_repeatable(stories_server):
    r = complete(stories_server, max_tokens=12, temperature=0.0, seed=7)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= 12
    assert out["usage"]["completion_tokens"] == len(ids)
    assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"])
    assert choice["finish_reason"] in ("length", "stop")
    assert isinstance(choice["message"]["content"], str)
    again = complete(stories_server, max_tokens=12, temperature=0.0).json()
    assert again["choices"][0]["token_ids"] == ids and again["prompt_token_ids"] == out["prompt_token_ids"]


def test_generation_length_cut_is_flagged(stories_server):
    out = complete(stories_server, max_tokens=3, temperature=0.0).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert len(out["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("body, status, words", [
    ({"n": 2}, 422, "n"),
    ({"stream": True}, 422, "stream"),
    ({"logit_bias": {"1": 5}}, 422, "logit_bias"),
    ({"chat_template_kwargs": {"tokenize": True}}, 422, "not accepted"),
    ({"chat_template_kwargs": {"enable_thinking": {"__class__": 1}}}, 422, "bool, number or short string"),
    ({"max_tokens": 10**6}, 400, "max_model_len"),
    ({"model": "other-model"}, 400, "not served"),
    ({"stop": ""}, 422, "must not be empty"),  # vLLM's VLLMValidationError (not a ValueError) was a 500
    ({"stop": ["x", ""]}, 422, "must not be empty"),
])
def test_generation_bad_input_is_refused_clearly(stories_server, body, status, words):
    r = complete(stories_server, **body)
    assert r.status_code == status, r.text
    assert words in r.text


def test_seed_on_the_cpu_backend_is_refused_and_the_engine_lives(stories_server):
    """vLLM's CPU worker calls Generator.set_offset for a seeded request after a chunked
    prefill step, which CPU generators lack: the engine died (stories' prompt is chunked
    at --max-num-batched-tokens 64). Refused before the engine instead."""
    long_chat = [{"role": "user", "content": "Tell me a long story about a dog and a cat. " * 8}]
    r = httpx.post(stories_server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": long_chat, "max_tokens": 4, "temperature": 0.8, "seed": 3})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    assert httpx.get(stories_server.url + "/health", timeout=10).status_code == 200
    assert complete(stories_server, max_tokens=2, temperature=0.8).status_code == 200


def test_hidden_states_take_allowed_template_kwargs(stories_server):
    chat = [*CHAT, {"role": "assistant", "content": "Once upon a time."}]
    ok = httpx.post(stories_server.url + "/tokenize",
                    json={"messages": chat, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    assert ok.status_code == 200, ok.text
    bad = httpx.post(stories_server.url + "/hidden_states",
                     json={"messages": chat, "chat_template_kwargs": {"add_generation_prompt": True}}, timeout=60)
    assert bad.status_code == 422 and "add_generation_prompt" in bad.text and "allowed" in bad.text


def test_content_parts_render_as_strings_on_every_route(stories_server):
    """Issue 36.0: a list of text parts went through the llama3 template as Python text."""
    chat = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Once upon a time."}]
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in chat]
    url = stories_server.url
    want, got = (httpx.post(url + "/tokenize", json={"messages": c}, timeout=60).json() for c in (chat, parts))
    assert got["token_ids"] == want["token_ids"] and got["loss_mask"] == want["loss_mask"]
    gen = [complete(stories_server, messages=c, max_tokens=2, temperature=0.0).json() for c in (chat[:1], parts[:1])]
    assert gen[0]["prompt_token_ids"] == gen[1]["prompt_token_ids"]
    states = [httpx.post(url + "/hidden_states", json={"messages": c}, headers={"Accept-Encoding": "identity"},
                         timeout=60) for c in (chat, parts)]
    assert states[0].status_code == states[1].status_code == 200, states[1].text
    a, b = (decode(r.content) for r in states)  # (each body's header names its own request id)
    assert a.token_ids.tolist() == b.token_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    assert torch.equal(a.hidden_states, b.hidden_states)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
             chat[1]]
    for route in ("/tokenize", "/hidden_states"):
        r = httpx.post(url + route, json={"messages": image}, timeout=60)
        assert r.status_code == 400 and "messages[0].content[0]" in r.text and "image_url" in r.text, r.text
    r = complete(stories_server, messages=image[:1], max_tokens=2)
    assert r.status_code == 400 and "image_url" in r.text, r.text
