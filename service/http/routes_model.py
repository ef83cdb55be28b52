"""What a client learns about the model: /info, /final_norm and /tokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hsx.protocol import final_norm as final_norm_body
from hsx.wire import MEDIA_TYPE
from hsx_service.core.errors import NotAvailable
from hsx_service.core.schema import HiddenStatesRequest
from hsx_service.http.schema import TokenizeResponse
from hsx_service.http.state import BAD_INPUT, ERRORS, request_key, serving

router = APIRouter()


@router.get("/info", summary="Model, layers, hidden size, dtype, limits, versions", responses=ERRORS)
async def info(request: Request):
    s = serving(request)
    f, card, norm = s.prefill.facts, s.service.card, s.final_norm
    return {
        "model": card["model"],
        "model_path": card["model_path"],
        "model_revision": f.revision,
        "architecture": f.architecture,
        "layer_ids": f.layer_ids,
        "num_hidden_layers": card["num_hidden_layers"],
        "hidden_size": card["hidden_size"],
        "dtype": card["dtype"],
        "max_model_len": f.max_model_len,
        "max_tokens_per_request": s.service.max_tokens,
        "vocab_size": f.vocab_size,
        # What bounds one sample: its tokens (max_model_len) only. States larger than the stream
        # window pass through it in token chunks; the arena bounds unsent bytes of all requests.
        "bounds": {
            "max_model_len": f.max_model_len,
            "arena_bytes": s.prefill.allocator.size,
            "stream_window_bytes": s.prefill.window_bytes,
            "sample_bound": "max_model_len",
        },
        "last_layer_pre_norm": True,
        "regeneration": regeneration_capture(s.prefill.vllm_config),
        "final_norm": None if norm is None else {"eps": norm.eps, "style": norm.style, "tensor": norm.tensor_name},
        "chat_template_sha256": s.service.tokenizer.template_sha256,
        "vllm_version": card["vllm_version"],
        "hsx_version": card["hsx_version"],
        "shm_lease": None if s.arena_socket is None or not s.lease_policy.may_lease(request_key(request)) else {
            "socket": s.arena_socket.address,
            "arena_id": s.prefill.arena.arena_id,
            "boot_id": s.arena_socket.boot_id,
            "lease_timeout": s.settings.lease_timeout,
        },
    }


@router.get(
    "/final_norm",
    summary="The final norm's weight (float32), epsilon and style, as safetensors",
    response_class=Response,
    responses={200: {"content": {MEDIA_TYPE: {}}}, **ERRORS},
)
async def final_norm(request: Request):
    s = serving(request)
    norm = s.final_norm
    if norm is None:
        raise NotAvailable(f"the final norm could not be read from the checkpoint: {s.final_norm_error}")
    return Response(final_norm_body.encode(norm.weight, norm.eps, norm.style, norm.tensor_name), media_type=MEDIA_TYPE)


@router.post(
    "/tokenize",
    summary="Token ids and loss mask of an input, as /hidden_states would prefill them, without the engine",
    response_model=TokenizeResponse,
    responses={**ERRORS, **BAD_INPUT},
)
async def tokenize(body: HiddenStatesRequest, request: Request):
    return await serving(request).service.tokenize(body, request.state.request_id, request.state.ticket.client)


def regeneration_capture(vllm_config) -> dict:
    """What `hsx regenerate --extract-to` needs to capture states in one generation pass
    (client/regenerate/one_pass.py): the capture layer writes every forwarded token's
    states into KV pages, so with prefix caching on a /hidden_states request for the
    generated conversation's ids, sent right after its generation, computes only its last
    (partial) block; without prefix caching it would prefill the conversation again."""
    cache = getattr(vllm_config, "cache_config", None)
    prefix = bool(getattr(cache, "enable_prefix_caching", False))
    return {"one_pass": prefix, "prefix_caching": prefix, "block_size": getattr(cache, "block_size", None)}
