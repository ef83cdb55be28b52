"""POST /v1/chat/completions: generation on the embedded engine (an OpenAI-compatible subset).

So one `hsx serve` deployment can both regenerate a chat corpus with the target
(`hsx regenerate`) and extract its hidden states. Non-streaming, n=1. The answer carries
the token ids as vLLM's own `return_token_ids` does (`prompt_token_ids` at the top,
`token_ids` in the choice), so a client never re-tokenizes generated text. Same guard as
/hidden_states: API key, body limits, --max-text-bytes, the admission gate (prompt plus
max_tokens count against --max-queued-tokens), the tokenizer processes' fair share and
bounded work (tokenize_pool.py), images in user messages with the same parts, limits and
handling (service/media), errors as {"error": {type, message}}.

Reasoning: `hsx serve --reasoning-parser NAME` is vLLM's own engine flag; with it, the
reply's text is split into `reasoning_content` and `content` by vLLM's parser of that name,
the way `vllm serve` splits it.

States of a generated conversation: the capture layer writes them into KV pages at every
forward of a generation too (prefill and decode steps), and with prefix caching a
/hidden_states request for the conversation's ids right after reuses those pages, computing
only the last partial block: `hsx regenerate --extract-to` in one pass
(client/regenerate/one_pass.py; /info's `regeneration` says whether this server can).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from hsx_service.engine import vllm_compat
from hsx_service.engine.prefill import engine_error
from hsx_service.http.disconnect import race_client
from hsx_service.core.errors import BadInput, ClientGone, Draining, EngineFailure, NotAvailable, NotReady, StartupError
from hsx_service.core.schema import ChatMessage, check_template_kwargs
from hsx_service.http.schema import ErrorResponse
from hsx_service.text_bounds import check_message_count, check_text_bytes, is_long

ROUTE = "/v1/chat/completions"


class ChatCompletionRequest(BaseModel):
    """The subset hsx serves; any other field is refused (422), never silently ignored.
    No top_k: on vLLM's CPU backend a top_k request under hsx's speculative config (the
    rejection sampler) stopped the engine (tests/test_service_schemathesis.py found it)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Must name the served model when given")
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most (default: up to max_model_len)")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = None
    n: Literal[1] = 1
    stop: str | list[str] | None = Field(None, description="Stop strings (none empty; at most 16)")
    stream: Literal[False] = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = Field(None, description="Accepted for vLLM compatibility; ids always come back")
    skip_special_tokens: bool = True
    id: str | None = Field(None, max_length=256, description="The caller's id, echoed as caller_id")

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="after")
    def _one_limit(self) -> "ChatCompletionRequest":
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("at most 16 stop strings")
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
            raise ValueError("stop strings must not be empty")
        return self


class ReasoningSplitter:
    """vLLM's reasoning parser of the engine's --reasoning-parser, on the engine's tokenizer."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.reasoning import ReasoningParserManager

        try:
            cls = ReasoningParserManager.get_reasoning_parser(name)
        except Exception as exc:
            raise StartupError(f"--reasoning-parser {name!r}: {exc}") from exc
        try:
            self.parser = cls(tokenizer)
        except Exception as exc:  # e.g. the model's vocabulary has no <think> token
            raise StartupError(f"--reasoning-parser {name!r} cannot parse this model's output: {exc}") from exc
        self.name = name

    def split(self, text: str, body: ChatCompletionRequest) -> tuple[str | None, str | None]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

        request = VllmRequest(model=body.model or "hsx", messages=[],
                              chat_template_kwargs=body.chat_template_kwargs)
        return self.parser.extract_reasoning(text, request)


def reasoning_splitter(prefill: Any) -> ReasoningSplitter | None:
    """The splitter for the engine's --reasoning-parser, or None when it has none."""
    config = getattr(prefill.vllm_config, "structured_outputs_config", None)
    name = getattr(config, "reasoning_parser", None)
    if not name:
        return None
    return ReasoningSplitter(name, prefill.engine.tokenizer)


def sampling_params(body: ChatCompletionRequest, prompt_tokens: int, max_model_len: int) -> Any:
    from vllm import SamplingParams

    room = max_model_len - prompt_tokens
    if room < 1:
        raise BadInput(f"the prompt has {prompt_tokens} tokens, leaving no room to generate "
                       f"within max_model_len {max_model_len}")
    asked = body.max_tokens or body.max_completion_tokens
    if asked is not None and asked > room:
        raise BadInput(f"max_tokens {asked} + the prompt's {prompt_tokens} tokens exceed max_model_len "
                       f"{max_model_len}; ask for at most {room}")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    seed = body.seed if body.temperature > 0 else None  # greedy: a seed changes nothing
    if seed is not None and vllm_compat.is_cpu_backend():
        # vLLM's CPU worker rewinds a seeded request's generator after a chunked prefill
        # step with Generator.set_offset, which CPU generators lack: the engine dies.
        raise BadInput("seed is not available on vLLM's CPU backend (a seeded request whose prefill is "
                       "chunked stops its engine); leave seed out, or use temperature 0 for a reproducible reply")
    try:
        return SamplingParams(
            max_tokens=asked or room, temperature=body.temperature, top_p=body.top_p,
            seed=seed, stop=stop or None,
            skip_special_tokens=body.skip_special_tokens, n=1,
        )
    except vllm_compat.input_refusals() as exc:  # vLLM's own checks of the sampling values
        raise BadInput(f"vLLM refused the sampling parameters: {exc}") from None


class Generator:
    """One chat completion on the prefill engine's AsyncLLM (never with hsx's capture params, so
    the connector copies nothing for it)."""

    def __init__(self, st: Any) -> None:
        self.st = st
        self.splitter = reasoning_splitter(st.prefill)

    async def complete(self, body: ChatCompletionRequest, request_id: str, ticket: Any) -> dict:
        st = self.st
        service, facts = st.service, st.prefill.facts
        if body.model is not None and body.model not in (facts.served_model_name, facts.model):
            raise BadInput(f"model {body.model!r} is not served here; this server serves {facts.served_model_name!r}")
        check_message_count(body.messages, st.settings.max_messages)  # 413, as on /hidden_states
        # Images as on /hidden_states (service/media): loaded within the limits, placeholders in their
        # place, so the image bytes count against no text bound and never reach the tokenizer processes.
        body, images = await service.media.take(body)
        size = check_text_bytes(body, service.max_text_bytes)  # /hidden_states' bound (text_bounds.py)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        # A prompt past the context is refused once its tokenizing passes it (never tokenized whole).
        most = facts.max_model_len - 1
        enc = await service.tokenizer.encode("generation", messages, body.tools, None, body.chat_template_kwargs,
                                             client=ticket.client, long=is_long(size, most), most=most)
        if not enc.complete:
            raise BadInput(f"the prompt has more than {most} tokens, leaving no room to generate within "
                           f"max_model_len {facts.max_model_len}")
        if not enc.token_ids:
            raise BadInput("the chat renders to zero tokens")
        if images:  # the model's processor expands each placeholder; the engine gets its prompt as made
            enc = await service.media.expand(enc, images, len(enc.token_ids), most,
                                             "max_model_len less one token to generate")
        prompt = enc.token_ids
        params = sampling_params(body, len(prompt), facts.max_model_len)
        ticket.admit(len(prompt) + params.max_tokens)
        final = await self._generate(prompt, params, request_id, enc.engine_input)
        out = final.outputs[0]
        text = out.text
        reasoning = None
        if self.splitter is not None:
            reasoning, text = self.splitter.split(text, body)
        completion_ids = list(out.token_ids)
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": facts.served_model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text, "reasoning_content": reasoning},
                "finish_reason": out.finish_reason or "stop",
                "stop_reason": out.stop_reason if isinstance(out.stop_reason, (str, int)) else None,
                "token_ids": completion_ids,
            }],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion_ids),
                      "total_tokens": len(prompt) + len(completion_ids)},
            "prompt_token_ids": prompt,
            "caller_id": body.id or "",
        }

    async def _generate(self, prompt: list[int], params: Any, request_id: str, engine_input: Any = None) -> Any:
        """`engine_input`: the prompt vLLM's renderer made of a chat with images (pixels and all)."""
        if engine_input is None:
            from vllm.inputs import TokensPrompt

            engine_input = TokensPrompt(prompt_token_ids=prompt)
        engine = self.st.prefill.engine
        # The engine request gets an id of its own: the caller's X-Request-Id may repeat.
        engine_id = f"gen-{request_id}-{uuid.uuid4().hex[:8]}"
        final = None

        async def run() -> None:
            nonlocal final
            async for output in engine.generate(engine_input, params, engine_id):
                final = output

        task = asyncio.get_running_loop().create_task(run())
        timeout = self.st.settings.request_timeout
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except BaseException as exc:
            await self.st.prefill.abort(engine_id, task)
            task.cancel()
            answer = engine_error(exc, timeout)
            if answer is not None:
                raise answer from exc
            raise
        if final is None or not final.finished:
            raise EngineFailure("the engine ended the request without a finished output")
        return final


def router() -> APIRouter:
    api = APIRouter()
    errors = {code: {"model": ErrorResponse} for code in (400, 401, 413, 415, 422, 500, 503, 504)}

    @api.post(ROUTE, summary="Generate one assistant reply (OpenAI-compatible subset, token ids included)",
              responses=errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        st = request.app.state.hsx
        if st.service is None:
            raise NotReady("the engine is still loading; retry shortly", retry_after=5, reason="loading")
        gen = getattr(st, "generator", None)
        if gen is None:
            raise NotAvailable("generation is not served by this process")
        work = asyncio.ensure_future(gen.complete(body, request.state.request_id, request.state.ticket))
        # The one owner of the client-leaving race (http/disconnect.py): cancelling the work
        # aborts the engine request.
        (await race_client(work, request.receive, st.cut_off.wait())).cancel()
        if not work.done():
            work.cancel()
            if st.cut_off.is_set():
                raise Draining("the server shut down before this request finished (--shutdown-timeout)",
                               retry_after=5, reason="cut_off")
            raise ClientGone("the client left before the answer")
        return work.result()

    return api
