"""Request schema of POST /hidden_states and /tokenize, and the chat messages and template
switches the generation route shares (pydantic; the OpenAPI schema comes from it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

# chat_template_kwargs a request may set: the reasoning switches of the common templates
# (Qwen3 enable_thinking, DeepSeek-V3.1/Kimi thinking, gpt-oss reasoning_effort). Plain
# scalars only: a template is code, and nothing a request sends may reach it as a callable
# or override what the renderer itself passes (messages, tools, add_generation_prompt).
TEMPLATE_KWARGS = ("enable_thinking", "thinking", "reasoning_effort", "thinking_budget", "add_vision_id",
                   "keep_reasoning", "preserve_thinking")


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    unknown = sorted(k for k in value if k not in TEMPLATE_KWARGS)
    if unknown:
        raise ValueError(f"chat_template_kwargs {unknown} are not accepted; allowed: {', '.join(TEMPLATE_KWARGS)}")
    bad = sorted(k for k, v in value.items() if not isinstance(v, (bool, int, float, str)) or
                 (isinstance(v, str) and len(v) > 64))
    if bad:
        raise ValueError(f"chat_template_kwargs {bad} must be a bool, number or short string")
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, tool_call_id ... go to the template

    role: str = Field(..., min_length=1)
    content: str | list[dict[str, Any]] | None = None


class HiddenStatesRequest(BaseModel):
    """Exactly one of `input_ids`, `prompt`, `messages`."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=256, description="The caller's id, echoed in the metadata")
    input_ids: list[StrictInt] | None = Field(None, description="Token ids, used as they are")
    loss_mask: list[Literal[0, 1]] | None = Field(None, description="0/1 per input id (with input_ids only)")
    prompt: str | None = Field(None, description="Text, tokenized with the model's tokenizer")
    messages: list[ChatMessage] | None = Field(None, description="A chat, rendered with the chat template")
    tools: list[dict[str, Any]] | None = Field(None, description="Tool definitions passed to the template")
    chat_template: str | None = Field(None, max_length=200_000, description="Jinja template overriding the server's")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description=f"Template switches, for messages (allowed: {', '.join(TEMPLATE_KWARGS)})"
    )
    assistant_mask: Literal["all", "last"] = Field(
        "all", description="Supervise every assistant turn, or only the last one"
    )
    add_special_tokens: bool = Field(True, description="For `prompt`: add the tokenizer's BOS etc.")
    layers: list[StrictInt] | None = Field(None, description="A subset of the served layer ids")
    max_length: int | None = Field(None, ge=1, description="Keep at most this many tokens")
    truncation: Literal["error", "right", "left"] = Field(
        "error", description="Over max_length: refuse, or drop tokens at the end / at the start"
    )
    require_supervised: bool = Field(
        False,
        description="Refuse (422 no_supervised_tokens) an input whose loss mask, after truncation, "
        "supervises no token; checked before the engine, so such a row costs no prefill",
    )

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="after")
    def _one_input(self) -> "HiddenStatesRequest":
        given = [k for k in ("input_ids", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of input_ids, prompt, messages"
                + (f" (got {', '.join(given)})" if given else " (got none)")
            )
        if self.loss_mask is not None and self.input_ids is None:
            raise ValueError("loss_mask goes with input_ids only (for messages the server computes it)")
        if (self.tools is not None or self.chat_template is not None or self.chat_template_kwargs is not None) \
                and self.messages is None:
            raise ValueError("tools, chat_template and chat_template_kwargs go with messages only")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids is empty")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.input_ids or []):
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for {len(self.input_ids or [])} input_ids"
            )
        if self.layers is not None and not self.layers:
            raise ValueError("layers is empty (leave it out for all served layers)")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            # Refused rather than merged: the states come back once per distinct layer, so a
            # caller counting on one row per entry would read the wrong layers.
            repeated = sorted({k for k in self.layers if self.layers.count(k) > 1})
            raise ValueError(f"layers repeats {repeated}; name each layer once")
        return self
