"""One conversation regenerated turn by turn against the model's own earlier replies.

System, user and tool messages stay as recorded. Each assistant turn of the recording
(and a reply after a user turn that has none, such as the last turn of a prompt row or
MT-Bench's questions) is generated from the messages so far, the model's own earlier
replies included. The conversation ends early, keeping what was generated, at:
  * with `stop_at_length`, a turn cut by max_tokens (finish_reason "length"): later turns
    would answer a reply the model never finished. Without it (the default) the cut turn
    stays the context of the next ones; either way its finish_reason flags it;
  * a turn whose tool calls cannot be paired with the recorded results: the recorded
    tool messages answer the recorded calls, so they follow the regenerated turn only
    when it calls the same functions in the same order (ids taken from the recording);
  * a turn whose prompt leaves no room in the model's context (the server refuses it as
    too long): "context_full". When that is the first turn, nothing is kept
    (`ContextFull`: the run counts the conversation as dropped, as extract drops a row
    with nothing to supervise).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hsx_client.errors import BadRequestError, HsxError, PayloadTooLargeError

from .mix import Variant, pick

Complete = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

# Fields of a recorded message that the chat request carries (others are the data's own).
_SENT_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


class NoTokenIds(HsxError):
    """The endpoint answered without token ids: refused, never re-tokenized."""


class ContextFull(HsxError):
    """The conversation's first reply already has no room in the model's context."""


# How hsx serve and vLLM word a prompt with no room left to generate.
_TOO_LONG = ("max_model_len", "maximum context length", "too long", "exceed")


def _too_long(exc: HsxError) -> bool:
    return isinstance(exc, PayloadTooLargeError) or (
        isinstance(exc, BadRequestError) and any(w in str(exc).lower() for w in _TOO_LONG))


@dataclass
class Sampling:
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # the run's seed; each conversation's is derived from it and its key
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None
    stop_at_length: bool = False
    mix: list[Variant] | None = None  # --mix: one variant per conversation overrides the fields above

    def conversation_seed(self, key: str) -> int | None:
        if self.seed is None:
            return None
        digest = hashlib.sha256(f"{self.seed}:{key}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def for_conversation(self, key: str) -> tuple["Sampling", Variant | None]:
        """The settings conversation `key` is generated with, and its --mix variant (None
        without a mix)."""
        if not self.mix:
            return self, None
        variant = pick(self.mix, self.seed, key)
        return self.for_variant(variant), variant

    def for_variant(self, variant: Variant) -> "Sampling":
        """These settings with a --mix variant's overrides."""
        o = dict(variant.overrides)
        kwargs = {**(self.chat_template_kwargs or {}), **(o.pop("chat_template_kwargs", None) or {})}
        if "reasoning_effort" in o:
            kwargs["reasoning_effort"] = o.pop("reasoning_effort")
        return dataclasses.replace(self, **o, chat_template_kwargs=kwargs or None, mix=None)

    def describe(self) -> str:
        """The settings a request carries besides greedy defaults, as flags ("--seed 1 ...")."""
        parts = [f"--temperature {self.temperature:g}" if self.temperature else "",
                 f"--top-p {self.top_p:g}" if self.top_p != 1.0 else "",
                 f"--seed {self.seed}" if self.seed is not None else "",
                 f"--chat-template-kwargs {self.chat_template_kwargs}" if self.chat_template_kwargs else ""]
        return " ".join(p for p in parts if p)


@dataclass
class Regenerated:
    messages: list[dict[str, Any]]
    turns: list[dict[str, Any]] = field(default_factory=list)  # one per regenerated assistant message
    ended: str = "complete"  # complete | length | unpaired_tool_calls

    @property
    def generated_tokens(self) -> int:
        return sum(len(t["token_ids"]) for t in self.turns)


def _sent(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: msg[k] for k in _SENT_KEYS if k in msg}


def _reply_points(messages: list[dict[str, Any]]) -> list[int]:
    """Indexes where a reply is generated: each recorded assistant turn, and each user
    turn followed by no assistant turn (the next message is a user one, or none)."""
    points = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            points.append(i)
        elif m["role"] == "user" and (i + 1 == len(messages) or messages[i + 1]["role"] == "user"):
            points.append(i + 1)
    return points


def _pair_tool_calls(recorded: list[dict] | None, generated: list[dict] | None) -> list[dict] | None:
    """The generated calls with the recorded ids, when they call the same functions in
    the same order; None when they cannot be paired."""
    if not recorded or not generated or len(recorded) != len(generated):
        return None
    paired = []
    for r, g in zip(recorded, generated):
        if (r.get("function") or {}).get("name") != (g.get("function") or {}).get("name"):
            return None
        paired.append({**g, "id": r.get("id", g.get("id"))})
    return paired


async def regenerate(key: str, messages: list[dict[str, Any]], tools: list[dict] | None, sampling: Sampling,
                     complete: Complete) -> Regenerated:
    points = set(_reply_points(messages))
    out: list[dict[str, Any]] = []
    result = Regenerated(out)
    seed = sampling.conversation_seed(key)
    i = 0
    while i <= len(messages):
        if i in points:
            recorded = messages[i] if i < len(messages) and messages[i]["role"] == "assistant" else None
            try:
                answer = await complete(request_body(out, tools, sampling, seed, len(result.turns)))
            except HsxError as exc:
                if not _too_long(exc):
                    raise
                if not result.turns:
                    raise ContextFull(f"the first reply has no room in the model's context: {exc}",
                                      type="context_full") from exc
                while out and out[-1]["role"] != "assistant":  # end on the model's last reply
                    out.pop()
                result.ended = "context_full"
                return result
            msg, turn = reply_of(answer)
            follows_tools = i + 1 < len(messages) and messages[i + 1]["role"] == "tool"
            recorded_calls = (recorded or {}).get("tool_calls")
            if recorded_calls or follows_tools:
                paired = _pair_tool_calls(recorded_calls, msg.get("tool_calls"))
                if paired is None:
                    out.append(msg)
                    result.turns.append(turn)
                    result.ended = "unpaired_tool_calls"
                    return result
                msg["tool_calls"] = paired
            elif msg.get("tool_calls"):  # calls with no recorded results to answer them
                out.append(msg)
                result.turns.append(turn)
                result.ended = "unpaired_tool_calls"
                return result
            out.append(msg)
            result.turns.append(turn)
            if turn["finish_reason"] == "length" and sampling.stop_at_length:
                result.ended = "length"
                return result
            if recorded is not None:
                i += 1  # the recorded reply is replaced
                continue
        if i < len(messages):
            out.append(_sent(messages[i]))
        i += 1
    return result


def request_body(history: list[dict[str, Any]], tools: list[dict] | None, sampling: Sampling, seed: int | None,
             turn: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": history,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "return_token_ids": True,
        "model": sampling.model,
    }
    if tools:
        body["tools"] = tools
    if seed is not None:
        body["seed"] = (seed + turn) & 0x7FFFFFFF
    if sampling.chat_template_kwargs:
        body["chat_template_kwargs"] = sampling.chat_template_kwargs
    return body


def reply_of(answer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    choice = answer["choices"][0]
    ids, prompt = choice.get("token_ids"), answer.get("prompt_token_ids")
    if not isinstance(ids, list) or not isinstance(prompt, list):
        raise NoTokenIds("the server answered without token ids (prompt_token_ids and the choice's token_ids); "
                         "hsx regenerate needs them to extract token-exactly and never re-tokenizes text: use "
                         "hsx serve, or a vLLM server (it returns them for return_token_ids)",
                         type="no_token_ids")
    message = choice.get("message") or {}
    msg: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        msg["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        msg["tool_calls"] = message["tool_calls"]
    turn = {
        "prompt_token_ids": prompt,
        "token_ids": ids,
        "finish_reason": choice.get("finish_reason"),
    }
    return msg, turn
