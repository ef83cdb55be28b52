"""Samples from `hsx regenerate`'s output: the turns' recorded token ids, never re-tokenized,
and exactly the generated ones supervised (docs: README's regenerate recipe)."""

from __future__ import annotations

from typing import Any

from hsx_client.corpus.rows import NO_ASSISTANT, RowProblem, Sample


def _id_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)


def recorded_samples(name: str, n: int, source: str, turns: Any, mask_policy: str) -> list[Sample]:
    """A row of `hsx regenerate`: its turns' recorded token ids, never re-tokenized. Each
    turn's sample is its prompt ids followed by its generated ids, the generated ones
    (exactly those) supervised. all_turns: the last turn's sample, with each earlier
    turn's generated ids supervised too where they appear verbatim, in order, in its
    prompt (a template that re-renders earlier turns, e.g. without their reasoning,
    leaves those unsupervised: they are no longer the model's own tokens)."""
    if not isinstance(turns, list) or not all(
            isinstance(t, dict) and _id_list(t.get("prompt_token_ids")) and _id_list(t.get("token_ids")) for t in turns):
        raise RowProblem("'hsx_turns' must be a list of {prompt_token_ids, token_ids} integer lists")
    turns = [t for t in turns if t["token_ids"] and t["prompt_token_ids"]]
    if not turns:
        raise RowProblem("no regenerated turn holds generated tokens", NO_ASSISTANT)
    if mask_policy == "per_turn":
        return [Sample(f"{name}:{n}:t{k}", source,
                       {"input_ids": t["prompt_token_ids"] + t["token_ids"],
                        "loss_mask": [0] * len(t["prompt_token_ids"]) + [1] * len(t["token_ids"])})
                for k, t in enumerate(turns, 1)]
    last = turns[-1]
    prompt = last["prompt_token_ids"]
    mask = [0] * len(prompt)
    at = 0
    for t in turns[:-1]:
        ids = t["token_ids"]
        found = _find_run(prompt, ids, at)
        if found >= 0:
            mask[found:found + len(ids)] = [1] * len(ids)
            at = found + len(ids)
    return [Sample(f"{name}:{n}:all", source,
                   {"input_ids": prompt + last["token_ids"], "loss_mask": mask + [1] * len(last["token_ids"])})]


def _find_run(seq: list[int], run: list[int], start: int) -> int:
    first, k = run[0], len(run)
    for i in range(start, len(seq) - k + 1):
        if seq[i] == first and seq[i:i + k] == run:
            return i
    return -1
