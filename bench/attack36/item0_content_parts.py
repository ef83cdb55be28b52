"""Issue 36.0 rerun: OpenAI content-part lists render as the equivalent string for string
templates and as parts for templates that iterate them, on /tokenize, /hidden_states, the
generation route and `hsx extract`'s inputs; a part hsx cannot render is refused by name.

    hsx serve stories260K --chat-template llama3.jinja --trust-request-chat-template &
    python bench/attack36/item0_content_parts.py --url http://127.0.0.1:PORT [--parts-template T.jinja]

--parts-template: a template that iterates content parts (the tiny Kimi-K2.5's
chat_template.jinja from `hsx make-tiny-model DIR --family kimi_k25`), sent per request.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx

from common import CHAT, STORIES, TEMPLATES, hsx, load
from record import record

PARTS = [{"type": "text", "text": "Hello there"}, {"type": "text", "text": "How are you?"}]
JOINED = "Hello there\nHow are you?"  # vLLM's join of text parts for a string template


def chat(content, reply="I am fine."):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content},
            {"role": "assistant", "content": reply}]


def tokenize(client, url, messages, template=None):
    body = {"messages": messages, **({"chat_template": template} if template else {})}
    r = client.post(url + "/tokenize", json=body)
    return r.status_code, (r.json() if r.status_code == 200 else r.text[:300])


def template_checks(client, url, decode) -> dict:
    """Every fixture template (sent per request): parts tokenize as the joined string, no repr."""
    out = {}
    for path in sorted(TEMPLATES.glob("*.jinja")):
        text = path.read_text()
        s1, a = tokenize(client, url, chat(PARTS), text)
        s2, b = tokenize(client, url, chat(JOINED), text)
        same = s1 == s2 == 200 and a["token_ids"] == b["token_ids"] and a["loss_mask"] == b["loss_mask"]
        out[path.name] = {"same_as_string": same, "repr_in_text": s1 == 200 and "'type'" in decode(a["token_ids"])}
    return out


def parts_template_check(client, url, template: Path, decode) -> dict:
    text = template.read_text()
    s1, a = tokenize(client, url, chat(PARTS), text)
    s2, b = tokenize(client, url, chat([{"type": "text", "text": "Hello there"}]), text)
    s3, c = tokenize(client, url, chat("Hello there"), text)
    rendered = decode(a["token_ids"]) if s1 == 200 else str(a)
    return {"status": [s1, s2, s3], "both_parts_rendered": "Hello there" in rendered and "How are you?" in rendered,
            "repr_in_text": "'type'" in rendered, "one_part_same_as_string": s2 == s3 == 200 and b["token_ids"] == c["token_ids"]}


def states_check(client, url) -> dict:
    from hsx.wire import decode

    got = [client.post(url + "/hidden_states", json={"messages": chat(c)}) for c in (PARTS, JOINED)]
    if any(r.status_code != 200 for r in got):
        return {"status": [r.status_code for r in got]}
    a, b = (decode(r.content) for r in got)
    return {"same_ids": a.token_ids.tolist() == b.token_ids.tolist(),
            "same_mask": a.loss_mask.tolist() == b.loss_mask.tolist(),
            "same_states": bool((a.hidden_states == b.hidden_states).all())}


def generation_check(client, url) -> dict:
    body = lambda c: {"messages": chat(c)[:2], "max_tokens": 8, "temperature": 0}  # noqa: E731
    a, b = (client.post(url + "/v1/chat/completions", json=body(c)) for c in (PARTS, JOINED))
    if a.status_code != 200 or b.status_code != 200:
        return {"status": [a.status_code, b.status_code], "error": a.text[:200]}
    ua, ub = a.json(), b.json()
    return {"same_prompt_tokens": ua["usage"]["prompt_tokens"] == ub["usage"]["prompt_tokens"],
            "same_reply": ua["choices"][0]["message"]["content"] == ub["choices"][0]["message"]["content"]}


def refusal_check(client, url) -> dict:
    image = [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    out = {}
    for route, extra in (("/tokenize", {}), ("/hidden_states", {}), ("/v1/chat/completions", {"max_tokens": 2})):
        r = client.post(url + route, json={"messages": chat(image)[:2] + ([] if extra else [chat(image)[2]]), **extra})
        out[route] = {"status": r.status_code, "error": r.text[:240]}
    return out


def extract_check(url: str, work: Path) -> dict:
    """hsx extract on the same OASST rows with string contents and with part lists."""
    rows = [json.loads(line) for line in (CHAT / "oasst" / "threads.messages.jsonl").open()][:12]
    parted = [{"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in r["messages"]]}
              for r in rows]
    samples = {}
    for name, data in (("strings", rows), ("parts", parted)):
        src = work / f"{name}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in data))
        run = hsx("extract", "--server", url, "--input", src, "--output", work / name, "--format", "speculators", "--no-shuffle", "--quiet")
        if run.returncode != 0:
            return {name: {"exit": run.returncode, "stderr": run.stderr[-400:]}}
        # each sample's record (ids crc, mask runs) and its states file's hash, in input order
        entries = [json.loads(line) for line in (work / name / "manifest.jsonl").open()]
        samples[name] = sorted((e["index"], e["record"], e["files"]) for e in entries)
    return {"samples": len(samples["strings"]), "identical_ids_and_masks": samples["strings"] == samples["parts"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--parts-template", type=Path)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(STORIES))
    decode = tok.decode
    before = load()
    with httpx.Client(timeout=300) as client, tempfile.TemporaryDirectory() as work:
        figures = {"server_template": tokenize(client, args.url, chat(PARTS))[0],
                   "templates": template_checks(client, args.url, decode),
                   "hidden_states": states_check(client, args.url),
                   "generation": generation_check(client, args.url),
                   "refused": refusal_check(client, args.url),
                   "extract": extract_check(args.url, Path(work))}
        if args.parts_template:
            figures["parts_template"] = parts_template_check(client, args.url, args.parts_template, decode)
    t = figures["templates"]
    figures["holds"] = (all(v["same_as_string"] and not v["repr_in_text"] for v in t.values())
                        and all(figures["hidden_states"].get(k) for k in ("same_ids", "same_mask", "same_states"))
                        and all(figures["generation"].get(k) for k in ("same_prompt_tokens", "same_reply"))
                        and all(v["status"] == 400 and "image_url" in v["error"] for v in figures["refused"].values())
                        and figures["extract"].get("identical_ids_and_masks") is True
                        and (not args.parts_template or (figures["parts_template"]["both_parts_rendered"]
                                                         and not figures["parts_template"]["repr_in_text"])))
    figures["load"] = max(before, load())
    record("0", figures)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
