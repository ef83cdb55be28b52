"""Issue 36.11 rerun: peers' clients against hsx serve. GET /v1/models as vLLM lists it, the
`openai` client's models.list() and chat.completions.create(), and speculators'
`regenerate-responses` without --model (it stopped with "No models found at endpoint"), whose
rows `hsx extract` turns into a corpus `hsx verify` accepts.

    hsx serve stories260K --chat-template llama3.jinja &
    python bench/attack36/item11_peer_clients.py --url http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from common import CHAT, env, hsx, load
from record import record


def speculators_then_extract(url: str, work: Path) -> dict:
    threads = (CHAT / "oasst" / "threads.messages.jsonl").read_text().splitlines()
    chats = work / "chats.jsonl"
    chats.write_text(threads[0] + "\n" + threads[3] + "\n")
    out = work / "regen.jsonl"
    r = subprocess.run([sys.executable, "-m", "speculators", "regenerate-responses", "--endpoint",
                        url + "/v1/chat/completions", "--dataset", str(chats), "--outfile", str(out),
                        "--max-tokens", "64", "--concurrency", "2", "--sampling-params", '{"temperature": 0}'],
                       capture_output=True, text=True, timeout=600, cwd=work,
                       env=env(HF_HOME=str(work / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    detected = [line.strip() for line in r.stdout.splitlines() if "Auto-detected model" in line]
    fig = {"exit": r.returncode, "auto_detected": detected[:1], "rows": 0}
    if r.returncode != 0 or not out.exists():
        fig["tail"] = (r.stdout + r.stderr)[-600:]
        return fig
    fig["rows"] = len(out.read_text().splitlines())
    ext = hsx("extract", "--server", url, "--input", out, "--output", work / "corpus", "--format", "speculators",
              "--quiet")
    ver = hsx("verify", work / "corpus")
    fig.update(extract_exit=ext.returncode, extract_summary=(ext.stdout + ext.stderr).strip().splitlines()[:1], verify_exit=ver.returncode, verify_tail=(ver.stdout + ver.stderr).strip()[-200:])
    return fig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    args = p.parse_args()
    import openai

    before = load()
    models = httpx.get(args.url + "/v1/models", timeout=30)
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="none")
    listed = [m.id for m in client.models.list()]
    reply = client.chat.completions.create(model=listed[0], max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Tell me a story."}])
    with tempfile.TemporaryDirectory() as work:
        spec = speculators_then_extract(args.url, Path(work))
    figures = {"v1_models_status": models.status_code, "v1_models": [{k: m.get(k) for k in ("id", "object", "owned_by", "max_model_len")}
                                                                  for m in models.json()["data"]] if models.status_code == 200 else None,
               "openai_models_list": listed, "openai_chat_reply_tokens": reply.usage.completion_tokens,
               "speculators": spec, "load": max(before, load())}
    figures["holds"] = (models.status_code == 200 and bool(listed) and reply.usage.completion_tokens > 0
                        and spec["exit"] == 0 and bool(spec["auto_detected"]) and spec.get("extract_exit") == 0
                        and spec.get("verify_exit") == 0)
    record("11", figures)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
