"""Fakes for tests/tools/test_first_hour.py and tests/tools/test_one_line_refusals.py: a MockTransport
server with the /info, truncation and require_supervised behaviour a test asks for, a fake
format with the real EAGLE-3 pre-flight, and the checks that a refused run left no trace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np

from hsx import wire
from hsx_client.corpus import extract as ex
from _extract_fakes import FakeFormat, FakeServer, hooks

L, H = 4, 8


def run(cfg, fmt, server):
    return ex.run_extract(cfg, hooks(fmt), transport=httpx.MockTransport(server))


class InfoServer(FakeServer):
    """FakeServer with an /info of our choosing and the server's require_supervised,
    truncation and num_input_tokens behaviour for the sample ids in `empty_mask` / `long`."""

    def __init__(self, **info):
        super().__init__()
        self.info = {"model": "tiny", "model_revision": "r1", "layer_ids": [1, 2, 3, 4], "num_hidden_layers": 4,
                     "hidden_size": H, "dtype": "float32", "max_model_len": 4096, "vocab_size": 100,
                     "max_tokens_per_request": 4095, "chat_template_sha256": None, **info}
        self.per_url: dict[str, dict] = {}
        self.bodies: list[dict] = []
        self.empty_mask: set[int] = set()  # first token -> all-zero mask after truncation
        self.long: set[int] = set()  # first token -> the server says it cut 1000 tokens

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/info":
            return httpx.Response(200, json={**self.info, **self.per_url.get(request.url.host, {})})
        if path == "/hidden_states":
            body = json.loads(request.content)
            self.bodies.append(body)
            ids = body["input_ids"]
            if ids[0] in self.empty_mask and body.get("require_supervised"):
                self.requests[body["id"]] += 1
                return httpx.Response(422, json={"error": {
                    "type": "no_supervised_tokens", "request_id": "r",
                    "message": "no supervised token after right truncation from 700 to 511 tokens: the loss mask is all zero"}})
            if ids[0] in self.long:
                self.requests[body["id"]] += 1
                t = len(ids)
                hs = np.zeros((t, L, H), np.float32)
                specs = [wire.TensorSpec("hidden_states", "F32", (t, L, H)), wire.TensorSpec("token_ids", "I64", (t,))]
                data = (wire.encode_header(specs, {"layer_ids": "[1,2,3,4]", "num_input_tokens": str(t + 1000)})
                        + hs.tobytes() + np.asarray(ids, np.int64).tobytes())
                return httpx.Response(200, content=data, headers={"Content-Type": wire.MEDIA_TYPE})
        return super().__call__(request)


class EagleFormat(FakeFormat):
    """The fake format with the real formats' EAGLE-3 pre-flight."""

    name = "speculators"

    def layer_problem(self, layers, num_hidden_layers, served):
        from hsx_client.corpus.formats.common import eagle3_layer_problem

        return eagle3_layer_problem(self.name, layers, num_hidden_layers, served)


def refused_and_untouched(r, out: Path, srv: InfoServer, words: str) -> None:
    assert r.exit_code == 2 and r.status == "refused", r.summary
    assert re.search(words, r.summary["message"]), r.summary["message"]
    assert "\n" not in r.summary["message"]
    assert not srv.bodies, "refused before any sample is sent"
    assert not out.exists(), f"a refused new run leaves no {out} (found {list(out.iterdir())})"
