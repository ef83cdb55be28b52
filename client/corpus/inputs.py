"""Input readers and sample planning: dataset rows -> `POST /hidden_states` bodies.

Sources (`read_samples(paths)`):
  * `*.jsonl` (one JSON object a line) and `*.json` (a list of objects; a `.json` file
    that is really JSON Lines is read as such);
  * a Hugging Face dataset directory (`save_to_disk` output, or anything `load_dataset`
    accepts locally: a folder of json/parquet/csv files); a DatasetDict uses `train`, or its
    only split;
  * a hub dataset `hf:org/name` or `hf:org/name:split` (default split `train`); this only
    works when the hub is reachable, and fails with a clear error otherwise.

Row kinds, detected per row (first match wins):
  * pre-tokenized `{"input_ids": [...], "loss_mask"?: [...]}` -> request `input_ids`(+`loss_mask`);
  * OpenAI `{"messages": [{role, content, tool_calls?, ...}], "tools"?}`;
  * ShareGPT `{"conversations": [{from, value}], "tools"?, "system"?}`; roles human/user,
    gpt/assistant (also chatgpt/bard/bing/model), system, function_call, observation (also
    tool/function). `function_call` becomes an assistant message whose *content* is the
    call text as written in the data (no `tool_calls` structure, so every chat template
    renders it); `observation` becomes a `tool` message. `tools` given as a JSON string
    (glaive / LLaMA-Factory) is parsed;
  * Alpaca `{"instruction", "input"?, "output", "system"?, "history"?}` ->
    [system], [history pairs], user(instruction + "\\n\\n" + input), assistant(output);
  * MT-Bench (FastChat/EAGLE files): a question row `{"question_id", "turns": [user...]}` and
    an answer row `{"question_id", "choices": [{"turns": [assistant...]}]}`. An answer row is
    joined with the question of the same id when a question file is among `paths`; a
    question that no answer uses has no assistant turn and is a BadRow, as is an answer
    whose question was not given;
  * plain `{"prompt": str}` or `{"text": str}` -> request `prompt`;
  * `hsx regenerate`'s output (OpenAI rows with `hsx_turns`): the recorded token ids, never
    re-tokenized (hsx_client.corpus.recorded); one with images is read from its messages
    (ids cannot carry the images), so its template renders the replies again.

Images (chat rows): OpenAI `image_url` parts, LLaVA / ShareGPT-4V `image` + `<image>`, a
dataset's image column; paths relative to the input file; see hsx_client.corpus.images.

mask_policy (chat rows only):
  * "per_turn" (speculators): one Sample per assistant turn, holding the messages up to and
    including that turn, `assistant_mask: "last"` (earlier turns are context);
  * "all_turns" (SpecForge): one Sample per conversation (trailing non-assistant messages
    dropped), `assistant_mask: "all"`.

Keys are `"{name}:{n}"` for prompt / pre-tokenized rows, `"{name}:{n}:t{k}"` for the k-th
(1-based) assistant turn under per_turn and `"{name}:{n}:all"` under all_turns. `name` is
the file (or directory) name, or the path as given when two inputs share a name; `n` is the
1-based line of a JSONL file, or the 1-based element of a JSON array / row of a dataset.
Keys depend only on the input files, so a resumed run plans the same keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsx_client.corpus import images
from hsx_client.corpus.recorded import recorded_samples
from hsx_client.corpus.rows import NO_ASSISTANT, QUESTION_ONLY, BadRow, RowProblem, Sample
from hsx_client.corpus.sources import open_source

MASK_POLICIES = ("per_turn", "all_turns")

_USER_ROLES = {"human": "user", "user": "user"}
_ASSISTANT_ROLES = {"gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                    "bard": "assistant", "bing": "assistant", "model": "assistant"}
_OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool", "function", "ipython"}


# ----------------------------------------------------------------------------- row kinds


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _parse_tools(tools: Any) -> list | None:
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise RowProblem(f"'tools' is a string but not JSON: {exc.msg}") from exc
        if tools in (None, [], ""):
            return None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowProblem("'tools' must be a list of objects (or a JSON string of one)")
    return tools


def _openai_messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise RowProblem("'messages' is empty or not a list")
    out = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RowProblem(f"message {j} is not an object")
        m = _drop_none(m)
        role = m.get("role")
        if role not in _OPENAI_ROLES:
            raise RowProblem(f"message {j} has unknown role {role!r}")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise RowProblem(f"message {j} ({role}) has no content")
        if content is not None and not isinstance(content, (str, list)):
            raise RowProblem(f"message {j} content must be a string or a list of parts")
        out.append(_with_reasoning(m, m))
    return out


def _sharegpt_messages(raw: Any, system: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise RowProblem("'conversations' is empty or not a list")
    out = []
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    for j, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise RowProblem(f"turn {j} is not an object")
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(text, str):
            raise RowProblem(f"turn {j} has no text value")
        if who in _USER_ROLES:
            role = "user"
        elif who in _ASSISTANT_ROLES or who == "function_call":
            role = "assistant"
        elif who == "system":
            role = "system"
        elif who in ("observation", "tool", "function"):
            role = "tool"
        else:
            raise RowProblem(f"turn {j} has unknown speaker {who!r}")
        out.append(_with_reasoning({"role": role, "content": text}, turn) if role == "assistant" else
                   {"role": role, "content": text})
    return out


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning(msg: dict, raw: dict) -> dict:
    """An assistant message's reasoning under `reasoning_content` (the key Qwen3-, DeepSeek-
    R1- and Kimi-style templates read), from whichever of REASONING_KEYS the data uses."""
    if msg.get("role") != "assistant" or "reasoning_content" in msg:
        return msg
    text = next((raw[k] for k in REASONING_KEYS if isinstance(raw.get(k), str) and raw[k]), None)
    return msg if text is None else {**msg, "reasoning_content": text}


def _alpaca_messages(row: dict) -> list[dict]:
    instr, inp, output = row.get("instruction"), row.get("input"), row.get("output")
    if not isinstance(instr, str) or not isinstance(output, str) or (inp is not None and not isinstance(inp, str)):
        raise RowProblem("Alpaca row needs string 'instruction', 'output' (and 'input' when present)")
    if not (instr.strip() or (inp or "").strip()):
        raise RowProblem("Alpaca row has an empty instruction and input")
    msgs: list[dict] = []
    if isinstance(row.get("system"), str) and row["system"]:
        msgs.append({"role": "system", "content": row["system"]})
    for pair in row.get("history") or []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise RowProblem("Alpaca 'history' must be a list of [user, assistant] pairs")
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = instr + ("\n\n" + inp if isinstance(inp, str) and inp else "")
    msgs += [{"role": "user", "content": user}, _with_reasoning({"role": "assistant", "content": output}, row)]
    return msgs


# The public reader of each chat row kind (`row_kind`'s names): its messages and tools
# (RowProblem when unusable).
CHAT_READERS: dict[str, Callable[[dict], tuple[list[dict], list | None]]] = {
    "openai": lambda row: (_openai_messages(row["messages"]), _parse_tools(row.get("tools"))),
    "sharegpt": lambda row: (_sharegpt_messages(row["conversations"], row.get("system")), _parse_tools(row.get("tools"))),
    "alpaca": lambda row: (_alpaca_messages(row), None),
}


def chat_messages(kind: str, row: dict, base_dir: Path | None) -> tuple[list[dict], list | None]:
    """A chat row's messages and tools, its images as `image_url` parts (hsx_client.corpus.images:
    relative paths from `base_dir`, the input's directory)."""
    msgs, tools = CHAT_READERS[kind](row)
    if images.has_images(row):
        msgs = images.resolve(msgs, row, base_dir)
    return msgs, tools


def _pretokenized(row: dict) -> dict:
    ids, mask = row["input_ids"], row.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RowProblem("'input_ids' must be a non-empty list of non-negative integers")
    req: dict = {"input_ids": ids}
    if mask is not None:
        if isinstance(mask, list) and all(isinstance(v, bool) for v in mask):
            mask = [int(v) for v in mask]
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(v in (0, 1) for v in mask):
            raise RowProblem(f"'loss_mask' must be a 0/1 list as long as input_ids ({len(ids)})")
        req["loss_mask"] = mask
    return req


def _chat_samples(name: str, n: int, source: str, msgs: list[dict], tools: list | None,
                  mask_policy: str) -> list[Sample]:
    turns = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise RowProblem("conversation has no assistant turn (nothing to supervise)", NO_ASSISTANT)
    extra = {"tools": tools} if tools else {}
    if mask_policy == "all_turns":
        body = {"messages": msgs[: turns[-1] + 1], **extra, "assistant_mask": "all"}
        return [Sample(f"{name}:{n}:all", source, body)]
    return [
        Sample(f"{name}:{n}:t{k}", source, {"messages": msgs[: j + 1], **extra, "assistant_mask": "last"})
        for k, j in enumerate(turns, 1)
    ]


def row_kind(row: Any) -> str:
    """The kind of one input row (module doc), first match wins; RowProblem when none fits."""
    if not isinstance(row, dict):
        raise RowProblem(f"row is a {type(row).__name__}, not an object")
    present = {k for k, v in row.items() if v is not None}
    if not present:
        raise RowProblem("empty row")
    if "input_ids" in present:
        return "pretokenized"
    if "messages" in present:
        return "openai"
    if "conversations" in present:
        return "sharegpt"
    if "instruction" in present and "output" in present:
        return "alpaca"
    if "question_id" in present and "choices" in present:
        return "mtbench_answer"
    if "question_id" in present and "turns" in present:
        return "mtbench_question"
    for k in ("prompt", "text"):
        if k in present:
            return k
    raise RowProblem(f"unknown row shape (keys: {sorted(row)[:12]})", "unknown_shape")


# ----------------------------------------------------------------------------- planning


def _join_mtbench(answers: list[tuple[str, int, str, dict]], questions: dict[Any, list[str]],
                  q_sources: dict[Any, str], mask_policy: str, samples: list[Sample], bad: list[BadRow],
                  max_samples: int | None) -> None:
    """MT-Bench answer rows joined to their questions (read from every input first) as chats;
    a question no answer used has no assistant turn to supervise: a BadRow."""
    q_used: set = set()

    def full() -> bool:
        return max_samples is not None and len(samples) >= max_samples

    for name, n, source, row in answers:
        if full():
            break
        try:
            qid = row["question_id"]
            choices = row["choices"]
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise RowProblem("MT-Bench 'choices' must be a non-empty list of objects")
            replies = choices[0].get("turns")
            if not isinstance(replies, list) or not replies or not all(isinstance(t, str) for t in replies):
                raise RowProblem("MT-Bench answer 'turns' must be a non-empty list of strings")
            if qid not in questions:
                raise RowProblem(f"MT-Bench answer for question_id {qid!r} without its question "
                           f"(pass question.jsonl among the inputs)")
            q_used.add(qid)
            msgs: list[dict] = []
            for q, a in zip(questions[qid], replies):
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            new = _chat_samples(name, n, source, msgs, None, mask_policy)
            samples.extend(new[: max_samples - len(samples)] if max_samples is not None else new)
        except RowProblem as exc:
            bad.append(BadRow(source, str(exc), exc.kind))
    for qid, src in q_sources.items():
        if qid not in q_used and not full():  # (when stopped early, unused is not unusable)
            bad.append(BadRow(src, "MT-Bench question with user turns only and no answer row "
                                   "(no assistant turn to supervise)", QUESTION_ONLY))


def read_samples(
    paths: list[str],
    *,
    mask_policy: str = "per_turn",
    bad_rows: list[BadRow] | None = None,
    max_samples: int | None = None,
) -> list[Sample]:
    """Read every input in `paths` and plan one Sample per request (see module doc).

    Unusable rows go to `bad_rows` (when given) and never stop the read; a missing file
    raises FileNotFoundError. Stops once `max_samples` samples are planned.
    """
    if mask_policy not in MASK_POLICIES:
        raise ValueError(f"mask_policy must be one of {MASK_POLICIES}, got {mask_policy!r}")
    bad = bad_rows if bad_rows is not None else []
    base = [p[3:] if p.startswith("hf:") else os.path.basename(os.path.normpath(p)) for p in paths]
    clash = {b for b in base if base.count(b) > 1}

    # MT-Bench questions are held until all files are read, answers joined afterwards.
    questions: dict[Any, list[str]] = {}
    q_sources: dict[Any, str] = {}
    answers: list[tuple[str, int, str, dict]] = []

    samples: list[Sample] = []

    def full() -> bool:
        return max_samples is not None and len(samples) >= max_samples

    for spec, b in zip(paths, base):
        name, rows = open_source(spec)
        base_dir = images.source_dir(spec)
        if b in clash:
            name = spec
        for n, row, err in rows:
            if full():
                break
            source = f"{spec}:{n}"
            if err is not None:
                bad.append(BadRow(source, str(err), getattr(err, "kind", "invalid_json")))
                continue
            try:
                kind = row_kind(row)
                if kind == "pretokenized":
                    samples.append(Sample(f"{name}:{n}", source, _pretokenized(row)))
                elif kind in ("prompt", "text"):
                    text = row[kind]
                    if not isinstance(text, str) or not text.strip():
                        raise RowProblem(f"'{kind}' must be a non-empty string, got {type(text).__name__}"
                                   + (" (an OpenAssistant tree? use the flattened threads file)"
                                      if isinstance(text, dict) else ""))
                    samples.append(Sample(f"{name}:{n}", source, {"prompt": text}))
                elif kind == "mtbench_question":
                    turns = row["turns"]
                    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                        raise RowProblem("MT-Bench 'turns' must be a non-empty list of strings")
                    questions[row["question_id"]] = turns
                    q_sources[row["question_id"]] = source
                elif kind == "mtbench_answer":
                    answers.append((name, n, source, row))
                else:
                    if kind == "openai" and row.get("hsx_turns") is not None and not images.has_images(row):
                        new = recorded_samples(name, n, source, row["hsx_turns"], mask_policy)  # hsx regenerate's output
                        samples.extend(new[: max_samples - len(samples)] if max_samples is not None else new)
                        continue
                    msgs, tools = chat_messages(kind, row, base_dir)
                    new = _chat_samples(name, n, source, msgs, tools, mask_policy)
                    samples.extend(new[: max_samples - len(samples)] if max_samples is not None else new)
            except RowProblem as exc:
                bad.append(BadRow(source, str(exc), exc.kind))

    _join_mtbench(answers, questions, q_sources, mask_policy, samples, bad, max_samples)
    return samples
