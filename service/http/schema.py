"""Response schema of the HTTP routes: /tokenize's answer, every error answer, the probes
(pydantic; the OpenAPI schema comes from it). The request schema is core/schema.py."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TokenizeResponse(BaseModel):
    """POST /tokenize: what /hidden_states would prefill for the same body."""

    token_ids: list[int]
    loss_mask: list[int] | None = Field(None, description="0/1 per token, when known")
    loss_mask_source: str = Field(..., description="request, chat_template or none")
    media_mask: list[int] | None = Field(None, description="1 on each image token (chats with images only)")
    layer_ids: list[int]
    model: str
    model_revision: str
    chat_template_sha256: str
    request_id: str
    caller_id: str
    num_input_tokens: int | None = Field(None, description="Tokens before truncation (hsx extract's disk estimate)")


class ErrorDetail(BaseModel):
    type: str
    message: str
    request_id: str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer."""

    error: ErrorDetail


class ProbeStatus(BaseModel):
    status: str
    error: str | None = None
