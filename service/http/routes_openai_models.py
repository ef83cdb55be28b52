"""GET /v1/models: the served model, listed as vLLM's OpenAI server lists it.

OpenAI-style clients ask this before they generate: the `openai` package's
`models.list()`, and speculators' `regenerate-responses`, which takes the first listed
id as the model to ask /v1/chat/completions for (without it: "No models found at
endpoint"). The answer has vLLM's shape and values (`ModelList` of `ModelCard`s:
`id` the served model name, `root` the model path, `owned_by` "vllm", `max_model_len`,
one permission record), so a client written against `vllm serve` reads it unchanged.
The id is the name /v1/chat/completions answers to (`ModelFacts.served_model_name`).
Behind the API key like every route that is not a probe (guard.py).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from hsx_service.http.state import ERRORS, serving

ROUTE = "/v1/models"


def _now() -> int:
    return int(time.time())


class ModelPermission(BaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: str = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str = Field(..., description="The served model name: what /v1/chat/completions takes as `model`")
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vllm"
    root: str | None = Field(None, description="The model path or hub id the engine loaded")
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


router = APIRouter()


@router.get(ROUTE, summary="The served model (OpenAI's model list, as vLLM serves it)", response_model=ModelList,
            responses=ERRORS)
async def list_models(request: Request) -> ModelList:
    facts = serving(request).prefill.facts
    card = ModelCard(id=facts.served_model_name, root=facts.model, max_model_len=facts.max_model_len,
                     permission=[ModelPermission()])
    return ModelList(data=[card])
