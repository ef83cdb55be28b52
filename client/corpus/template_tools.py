"""Does the servers' chat template render a row's `tools`? (issue 25)

A template that never reads `tools` (llama3.jinja, say, with glaive's function-calling
rows) renders those rows as if they had none: the corpus silently loses the tool
definitions. Reading the template's source for the word `tools` would be a guess (it may
be named in a comment, or reach the tools through another variable); rendering is not:
one row with tools is tokenized with and without them (`POST /tokenize`, no prefill) and
the same tokens, counted before truncation, mean the template ignores them. A template is
one piece of code for every row, so one probe per template (the server's, or a row's own
`chat_template`) speaks for all the rows that use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hsx_client.api import HsxClient
from hsx_client.errors import HsxError

PROBES = 3  # rows tried per template when one cannot be tokenized (a bad row is the run's business)


async def tools_not_rendered(client: HsxClient, requests: Iterable[dict[str, Any]], max_length: int | None) -> int:
    """How many of the chat `requests` carry `tools` that their chat template ignores."""
    by_template: dict[str | None, list[dict[str, Any]]] = {}
    for r in requests:
        if r.get("tools") and "messages" in r:
            by_template.setdefault(r.get("chat_template"), []).append(r)
    ignored = 0
    for rows in by_template.values():
        for probe in rows[:PROBES]:
            verdict = await _ignores_tools(client, probe, max_length)
            if verdict is not None:
                ignored += len(rows) if verdict else 0
                break
    return ignored


async def _ignores_tools(client: HsxClient, request: dict[str, Any], max_length: int | None) -> bool | None:
    """True: the same tokens without the tools; None: the row could not be tokenized."""
    body = {k: v for k, v in request.items() if k not in ("require_supervised", "id")}
    if max_length:
        body.update(max_length=max_length, truncation="right")
    bare = {k: v for k, v in body.items() if k != "tools"}
    try:
        with_tools, without = await client.tokenize(body), await client.tokenize(bare)
    except HsxError:
        return None

    def seen(answer: dict[str, Any]) -> tuple:
        return answer.get("num_input_tokens"), answer["token_ids"]

    return seen(with_tools) == seen(without)
