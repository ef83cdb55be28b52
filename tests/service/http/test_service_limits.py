"""Issue 11, fast: the bounds on a request's work, in process (no vLLM).

The assistant mask from a constant number of renderings equals the per-turn method on
the shared fixtures; right truncation's bounded prefix equals full tokenization; the
guard's body deadline, receiving bound and header limits; request templates refused
unless trusted; every answer counted by code; /docs offline. The same paths against a
real `hsx serve` are in test_service_hostile.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

from _server import CHAT, STORIES, TEMPLATES
from test_service_app import arena, client, make_app, metrics  # noqa: F401 (arena: a fixture)

from hsx_service.tokenize import Tokenizer, assistant_spans, per_turn_spans


@pytest.fixture(scope="module")
def tok():
    if not STORIES.exists():
        pytest.skip(f"shared fixtures not found at {STORIES}")
    return Tokenizer(str(STORIES), None, False, None)


def _oasst():
    return [(json.loads(line)["messages"], None) for line in (CHAT / "oasst" / "threads.messages.jsonl").open()]


def _glaive():
    rows = json.loads((CHAT / "llamafactory" / "glaive_toolcall_en_demo.json").read_text())
    role = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
    out = []
    for row in rows:
        tools = json.loads(row["tools"]) if row.get("tools") else None
        tools = [{"type": "function", "function": t} for t in tools] if tools else None
        out.append(([{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]], tools))
    return out


@pytest.mark.parametrize("chats,template", [
    (_oasst, "llama3.jinja"), (_glaive, "qwen2_5.jinja"),
    (_oasst, "llama3_training.jinja"),  # a {% generation %} template
    pytest.param(_glaive, "qwen2_5_training.jinja", marks=pytest.mark.slow),
    pytest.param(_oasst, "qwen3.jinja", marks=pytest.mark.slow),  # drops earlier reasoning: the fallback
])
def test_the_mask_equals_the_per_turn_method_on_the_fixtures(tok, chats, template):
    text = (TEMPLATES / template).read_text()
    for messages, tools in chats():
        def render(msgs, gen):
            return tok.tok.apply_chat_template(msgs, tools=tools, chat_template=text, tokenize=False,
                                               add_generation_prompt=gen)
        full = render(messages, False)
        assert assistant_spans(messages, full, render) == per_turn_spans(messages, full, render)


def test_a_long_chat_takes_a_constant_number_of_renderings(tok):
    template = (TEMPLATES / "llama3.jinja").read_text()
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(4096)]
    renders = []

    def render(msgs, gen):
        renders.append(len(msgs))
        return tok.tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = assistant_spans(messages, full, render)
    assert len(spans) == 2048 and len(renders) <= 4  # the per-turn method: 4097
    small = messages[:256]
    full = render(small, False)
    assert assistant_spans(small, full, render) == per_turn_spans(small, full, render)


def test_right_truncation_of_a_prompt_keeps_exactly_the_full_tokenization_s_first_tokens(tok):
    rng = random.Random(5)
    words = [m["content"] for messages, _ in _oasst()[:60] for m in messages]
    texts = [" ".join(words), "".join(words), " ".join(words).replace(" ", "   "),
             "".join(rng.choice("ab \n") for _ in range(40_000)), "x" * 50_000]
    for text in texts:
        for keep in (1, 37, 300):
            full = tok.tok(text)["input_ids"]
            got = tok.encode_prompt(text, True, keep).token_ids
            assert got == full[:keep], (text[:40], keep)


class _Counting:
    """The Tokenizer's tokenizer, recording the characters of each text it is given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def __call__(self, text, **kw):
        self.sizes.append(len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_text_past_the_limit_is_refused_from_a_bounded_prefix(tok, monkeypatch):
    """Issue 36.1: a 3.9 MB chat to /v1/chat/completions (or to /hidden_states without
    truncation) was tokenized whole, seconds of a tokenizer process each, before its refusal;
    now tokenizing stops past the limit, on every kind of input."""
    template = (TEMPLATES / "llama3.jinja").read_text()
    story = " ".join(m["content"] for messages, _ in _oasst()[:60] for m in messages)
    big = (story * (3_900_000 // len(story) + 1))[:3_900_000]
    counting = _Counting(tok.tok)
    monkeypatch.setattr(tok, "tok", counting)
    most = 511
    over = [tok.encode_generation_prompt([{"role": "user", "content": big}], None, template, None, most=most),
            tok.encode_chat([{"role": "user", "content": big}, {"role": "assistant", "content": "The end."}],
                            None, template, "all", most=most),
            tok.encode_prompt(big, True, None, most=most)]
    assert max(counting.sizes) <= 64 * most  # never the whole text
    for enc in over:
        assert not enc.complete and len(enc.token_ids) == most + 1
    full = counting.tok(big[:200_000], add_special_tokens=True)["input_ids"]
    assert over[2].token_ids == full[:most + 1]  # the first tokens of the full tokenization
    small = [{"role": "user", "content": "Tell me a story."}]
    fits = tok.encode_generation_prompt(small, None, template, None, most=most)
    assert fits.complete and fits.token_ids == tok.encode_generation_prompt(small, None, template, None).token_ids
    exact = tok.encode_prompt(story[:20_000], True, None, most=len(tok.encode_prompt(story[:20_000], True).token_ids))
    assert exact.complete  # exactly at the limit fits


# --------------------------------------------------------------------------- the guard

async def _asgi(app, scope_extra: dict, chunks: list[bytes | None]):
    """Call the app with a body sent in `chunks` (None: the client goes silent)."""
    sent = []
    queue = list(chunks)

    async def receive():
        if not queue:
            await asyncio.sleep(3600)
        chunk = queue.pop(0)
        if chunk is None:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/hidden_states", "raw_path": b"/hidden_states",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("app", 80), "client": ("test", 1), "root_path": "", **scope_extra}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body) if body else None


async def test_a_silent_body_gets_408_and_holds_no_admission_place(arena):  # noqa: F811
    app, st, _ = make_app(arena, body_timeout=0.3, max_inflight=1)
    status, body = await _asgi(app, {}, [b'{"input_', None])
    assert status == 408 and "--body-timeout" in body["error"]["message"] and "8 bytes" in body["error"]["message"]
    assert st.gate.in_flight == 0
    silent = asyncio.ensure_future(_asgi(app, {}, [None]))
    await asyncio.sleep(0.05)
    assert st.gate.in_flight == 0  # a client still sending holds no place
    async with client(app) as c:
        assert (await c.post("/hidden_states", json={"input_ids": [1, 2]})).status_code == 200
    assert (await silent)[0] == 408
    m = metrics(st)
    assert m.get("hsx_rejected_total", reason="body_timeout") == 2 and m.get("hsx_http_responses_total", code="408") == 2


async def test_full_receiving_places_refuse_silent_senders_but_take_arrived_bodies(arena):  # noqa: F811
    app, st, _ = make_app(arena, body_timeout=5, max_receiving=2)
    silent = [asyncio.ensure_future(_asgi(app, {}, [None])) for _ in range(2)]
    await asyncio.sleep(0.05)
    status, body = await _asgi(app, {}, [None])  # a third silent one: refused after the grace
    assert status == 503 and body["error"]["type"] == "overloaded"
    async with client(app) as c:
        assert (await c.post("/hidden_states", json={"input_ids": [1, 2]})).status_code == 200
    for t in silent:
        t.cancel()
    assert metrics(st).get("hsx_rejected_total", reason="receiving") == 1


async def test_header_count_and_size_answer_431(arena):  # noqa: F811
    app, st, _ = make_app(arena, max_headers=20, max_header_bytes=2048)
    async with client(app) as c:
        r = await c.get("/health", headers={f"x-{i}": "v" for i in range(30)})
        assert r.status_code == 431 and r.json()["error"]["type"] == "headers_too_large"
        assert (await c.get("/health", headers={"x-big": "v" * 4000})).status_code == 431
        assert (await c.get("/health")).status_code == 200
    m = metrics(st)
    assert m.get("hsx_http_responses_total", code="431") == 2 and m.get("hsx_http_responses_total", code="200") == 1


async def test_request_templates_and_oversized_text_are_refused_before_any_tokenizing(arena):  # noqa: F811
    app, st, _ = make_app(arena, max_text_bytes=1000)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    async with client(app) as c:
        r = await c.post("/hidden_states", json={"messages": chat, "chat_template": "{{ 1 }}"})
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
        r = await c.post("/hidden_states", json={"prompt": "é" * 501})  # 1002 bytes
        assert r.status_code == 413 and "--max-text-bytes" in r.json()["error"]["message"]
        r = await c.post("/hidden_states", json={"messages": [chat[0], {"role": "assistant", "content": "x" * 999}]})
        assert r.status_code == 413
    m = metrics(st)
    assert m.get("hsx_http_responses_total", code="400") == 1 and m.get("hsx_http_responses_total", code="413") == 2


async def test_docs_are_served_without_a_cdn(arena):  # noqa: F811
    from hsx_service.http.docs import asset_dir

    if asset_dir() is None:
        pytest.skip("this vLLM build ships no Swagger UI assets")
    app, _, _ = make_app(arena, api_key=["k" * 16])
    async with client(app) as c:
        page = (await c.get("/docs")).text
        assert "cdn." not in page and "/docs/swagger-ui-bundle.js" in page
        for path in ("/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"):  # public, like /docs
            r = await c.get(path)
            assert r.status_code == 200 and len(r.content) > 1000, path


def test_stale_notify_sockets_of_dead_servers_are_removed(tmp_path):
    import subprocess
    import sys

    from hsx_service.engine.notices import remove_stale_notify_sockets

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"hsx-notify-{dead.stdout.strip()}-abcd1234.sock"
    live = tmp_path / f"hsx-notify-{os.getppid()}-abcd1234.sock"
    stale.touch()
    live.touch()
    assert remove_stale_notify_sockets(str(tmp_path)) == [str(stale)]
    assert live.exists() and not stale.exists()


def test_hsx_serve_help_names_its_flags_and_the_engine_groups():
    pytest.importorskip("vllm")
    from hsx_service.cli import _vllm_parser, add_service_flags

    parser, _ = _vllm_parser()
    add_service_flags(parser)
    text = parser.format_help()
    assert "--help=hsx" in text and "--help=all" in text
    assert "--trust-request-chat-template" in {s for a in parser._actions for s in a.option_strings}


def test_hsx_serve_help_says_each_flags_default_once(capsys):
    """Issue 36.9: every hsx flag in `--help=hsx` ended `[env ...; default X] (default: None)`
    (vLLM's help formatter adds argparse's own default, None for every hsx flag)."""
    pytest.importorskip("vllm")
    from hsx_service.cli import parse
    from hsx_service.settings import FLAG_NAMES, ServiceSettings

    with pytest.raises(SystemExit) as exc:
        parse(["--help=hsx"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    shown = [n for n in FLAG_NAMES if f"--{n.replace('_', '-')} " in text]
    assert len(shown) >= len(FLAG_NAMES) - 3  # (a flag vLLM defines too is listed in vLLM's group)
    for name in shown:
        default = ServiceSettings.model_fields[name].get_default(call_default_factory=True)
        assert text.count(f"[env HSX_{name.upper()}; default {default!r}]") == 1, name
    settings, _ = parse(["some-model", "--api-key", "k", "--shm-lease", "false"])  # given flags still set
    assert settings.accepted_keys == ["k"] and settings.shm_lease is False
    settings, _ = parse(["some-model"])  # flags not given: the settings' defaults
    assert settings.accepted_keys == [] and settings.shm_lease is ServiceSettings.model_fields["shm_lease"].default


def test_hsx_serve_without_a_model_is_refused(monkeypatch):
    pytest.importorskip("vllm")
    from hsx_service.cli import parse
    from hsx_service.core.errors import StartupError

    monkeypatch.delenv("HSX_MODEL", raising=False)
    with pytest.raises(StartupError, match="hsx serve MODEL"):
        parse(["--port", "9005"])




def test_cpu_backend_gets_a_logged_kv_cache_default(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from hsx_service.cli import cpu_kv_cache_default

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu_kv_cache_default(["--gpu-memory-utilization", "0.1"])  # the user chose: left alone
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    cpu_kv_cache_default([])
    if current_platform.is_cpu():
        assert 1 <= int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) <= 8
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    cpu_kv_cache_default([])
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_an_engine_start_failure_is_one_line_with_its_cause():
    from hsx_service.lifecycle import start_failure

    try:
        try:
            raise ValueError("KV cache needs 9.0 GiB, 2.1 GiB free\nmore lines")
        except ValueError as inner:
            raise RuntimeError("Engine core initialization failed. See root cause above.") from inner
    except RuntimeError as exc:
        line = start_failure(exc)
    assert "\n" not in line and "Engine core initialization failed" in line and "9.0 GiB" in line
