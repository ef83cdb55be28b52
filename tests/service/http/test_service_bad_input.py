"""Each bad input gets a 4xx JSON error a person can act on, and the engine keeps serving."""

from __future__ import annotations

import httpx
import pytest

from hsx.wire import decode

pytestmark = pytest.mark.engine


def post(server, body=None, *, content=None, headers=None):
    return httpx.post(server.url + "/hidden_states", json=body, content=content, headers=headers, timeout=60)


def assert_error(r, status, *words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and err["request_id"]
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]
    assert "Traceback" not in r.text


@pytest.fixture
def still_serving(tiny_server):
    yield tiny_server
    r = post(tiny_server, {"input_ids": [1, 2, 3]})
    assert r.status_code == 200, "the engine stopped serving after a bad request"
    assert decode(r.content).hidden_states.shape[0] == 3
    assert httpx.get(tiny_server.url + "/health").status_code == 200


@pytest.mark.parametrize("body,words", [
    ({"input_ids": []}, ["input_ids is empty"]),
    ({"prompt": ""}, ["prompt is empty"]),
    ({"messages": []}, ["messages is empty"]),
    ({}, ["exactly one of", "got none"]),
])
def test_empty_input(still_serving, body, words):
    assert_error(post(still_serving, body), 422, *words)


def test_two_input_kinds(still_serving):
    assert_error(post(still_serving, {"input_ids": [1, 2], "prompt": "hi"}), 422, "exactly one", "input_ids, prompt")


@pytest.mark.parametrize("ids", [[1, 2.5], [1, "7"], [1, True], [1, None]])
def test_non_integer_ids(still_serving, ids):
    assert_error(post(still_serving, {"input_ids": ids}), 422, "input_ids")


@pytest.mark.parametrize("bad", [-1, 1024, 10**12])
def test_out_of_vocab_ids(still_serving, bad):
    assert_error(post(still_serving, {"input_ids": [1, bad]}), 400, "vocabulary", str(bad))


def test_prompt_longer_than_max_model_len(still_serving):
    r = post(still_serving, {"input_ids": [5] * 1024})  # max_model_len 1024 leaves room for 1023
    assert_error(r, 413, "1024 tokens", "truncation")
    long_text = "The quick brown fox jumps over the lazy dog. " * 300
    assert_error(post(still_serving, {"prompt": long_text}), 413, "max_model_len")


def test_truncation_instead_of_error(still_serving):
    ids = [6 + i % 990 for i in range(1100)]
    r = post(still_serving, {"input_ids": ids, "truncation": "left"})
    assert r.status_code == 200, r.text
    dec = decode(r.content)
    assert dec.token_ids.tolist() == ids[-1023:]
    r = post(still_serving, {"input_ids": list(range(6, 100)), "max_length": 10, "truncation": "right"})
    assert decode(r.content).token_ids.tolist() == list(range(6, 16))


def test_unknown_layer(still_serving):
    assert_error(post(still_serving, {"input_ids": [1, 2], "layers": [2, 4]}), 400, "[4]", "[1, 2, 3, 6]")


def test_loss_mask_length_mismatch(still_serving):
    assert_error(post(still_serving, {"input_ids": [1, 2, 3], "loss_mask": [0, 1]}), 422, "loss_mask")


def test_unknown_field_is_named(still_serving):
    assert_error(post(still_serving, {"input_id": [1, 2]}), 422, "input_id")


def test_malformed_json(still_serving):
    r = post(still_serving, content=b'{"input_ids": [1, 2', headers={"Content-Type": "application/json"})
    assert_error(r, 422, "json")


def test_wrong_content_type(still_serving):
    r = post(still_serving, content=b'{"input_ids": [1, 2]}', headers={"Content-Type": "text/plain"})
    assert_error(r, 415, "application/json")
    r = post(still_serving, content=b"input_ids=1", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_error(r, 415)


def test_chat_without_assistant_turn(still_serving):
    assert_error(post(still_serving, {"messages": [{"role": "user", "content": "hi"}]}), 400, "assistant")


def test_request_chat_template_refused_unless_trusted(still_serving):
    """Issue 11: a template is code; without --trust-request-chat-template it is refused
    (test_service_hostile.py has the trusted server: broken and hostile templates)."""
    r = post(still_serving, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                             "chat_template": "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"})
    assert_error(r, 400, "--trust-request-chat-template")


def test_repeated_layers_are_refused_by_name(still_serving):
    """Issue 25: `layers: [1, 1, 1]` was silently `[1]` (one row where the caller counted three)."""
    assert_error(post(still_serving, {"input_ids": [1, 2], "layers": [1, 1, 1]}), 422, "repeats [1]")
    assert_error(post(still_serving, {"input_ids": [1, 2], "layers": [6, 2, 6, 3, 2]}), 422, "repeats [2, 6]")
    r = post(still_serving, {"input_ids": [1, 2], "layers": [6, 2]})  # distinct, any order: fine
    assert r.status_code == 200 and decode(r.content).hidden_states.shape[1] == 2


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd", "gzip, identity"])
def test_a_compressed_request_body_is_refused(still_serving, coding):
    """Issue 25: a body with Content-Encoding was accepted (and parsed as if it were plain JSON)."""
    import gzip

    r = post(still_serving, content=gzip.compress(b'{"input_ids": [1, 2]}'),
             headers={"Content-Type": "application/json", "Content-Encoding": coding})
    assert_error(r, 415, "Content-Encoding", coding.split(",")[0], "uncompressed")
    r = post(still_serving, content=b'{"input_ids": [1, 2]}',
             headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
