"""The extract run loop's stand-ins: a fake format, fake inputs, a MockTransport server, the
config and hooks that put them together (test_extract_unit and the tests of the summary,
the refusals and the first hour use them)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import safetensors.numpy

from hsx import wire
from hsx_client.corpus import extract as ex
from hsx_client.corpus import journal, store
from hsx_client.corpus.formats.common import FormatDefaults
from hsx_client.settings import ClientSettings

L, H = 4, 8


# ------------------------------------------------------------------ fakes
@dataclass(frozen=True)
class Sample:
    key: str
    source: str
    request: dict


def fake_read_samples(paths, *, mask_policy="per_turn", bad_rows=None, **kw):
    out = []
    for p in paths:
        for n, line in enumerate(Path(p).read_text().splitlines(), 1):
            row = json.loads(line)
            if "input_ids" not in row:
                if bad_rows is not None:
                    bad_rows.append((p, n, "no input_ids"))
                continue
            out.append(Sample(f"{Path(p).name}:{n}", p, {"input_ids": row["input_ids"]}))
    return out


@dataclass
class FakeCtx:
    layer_ids: list
    hidden_size: int
    dtype: str
    final_norm: object
    draft_vocab_size: object
    vocab_size: object
    mask_policy: object = None


@dataclass
class SampleOutput:
    files: dict
    record: dict = field(default_factory=dict)


class Crash(BaseException):
    """Stands in for a kill: not an Exception, so nothing handles it as a sample error."""


class FakeFormat(FormatDefaults):
    name = "fake"

    def __init__(self):
        self.crash_after: int | None = None
        self.encoded = 0
        self.lock = threading.Lock()

    def bytes_per_token(self, ctx):
        return L * H * 4 + 8

    def encode_sample(self, index, decoded, ctx):
        with self.lock:
            self.encoded += 1
            if self.crash_after is not None and self.encoded > self.crash_after:
                raise Crash("simulated crash")
        ids = decoded.token_ids
        data = safetensors.numpy.save({"hidden_states": decoded.hidden_states.numpy(), "token_ids": ids})
        return SampleOutput({f"hs/hs_{index}.st": data}, {"num_tokens": int(len(ids)), "first": int(ids[0])})

    def finalize(self, out_dir, records, ctx):
        idx = [i for i, _ in records]
        assert idx == sorted(idx) and len(set(idx)) == len(idx)
        (Path(out_dir) / "index.json").write_text(json.dumps(records))
        return ["index.json"]

    def verify_sample(self, out_dir, index, record):
        try:
            t = safetensors.numpy.load_file(str(Path(out_dir) / f"hs/hs_{index}.st"))
        except Exception as exc:
            return [f"unreadable: {exc}"]
        if len(t["token_ids"]) != record["num_tokens"]:
            return ["token count differs"]
        return []


def hooks(fmt):
    return ex.Hooks(read_samples=fake_read_samples, get_format=lambda name: fmt, make_context=FakeCtx)


class FakeServer:
    """MockTransport handler: /info, /final_norm, /health, /hidden_states."""

    def __init__(self):
        self.requests: Counter = Counter()
        self.bad_ids: set[int] = set()  # first token -> 400
        self.down = False
        self.malformed = False  # 200 with a body cut short
        self.on_request = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.down and path != "/info" and path != "/final_norm":
            raise httpx.ConnectError("connection refused")
        if path == "/health":
            return httpx.Response(200)
        if path == "/tokenize":  # (an older server: the disk estimate counts characters)
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/info":
            return httpx.Response(200, json={
                "model": "tiny", "model_revision": "r1", "layer_ids": [1, 2, 3, 4], "num_hidden_layers": 4,
                "hidden_size": H, "dtype": "float32", "max_model_len": 4096, "vocab_size": 100,
                "vllm_version": "0.0", "hsx_version": "0.1.0", "chat_template_sha256": None,
            })
        if path == "/final_norm":
            return httpx.Response(200, content=safetensors.numpy.save(
                {"weight": np.ones(H, np.float32)}, metadata={"eps": "1e-05", "style": "rms"}))
        body = json.loads(request.content)
        ids = body["input_ids"]
        self.requests[body["id"]] += 1
        if self.on_request is not None:
            self.on_request(body)
        if ids[0] in self.bad_ids:
            return httpx.Response(400, json={"error": {"type": "invalid", "message": "bad sample", "request_id": "r"}})
        t = len(ids)
        hs = (np.arange(t * L * H, dtype=np.float32).reshape(t, L, H) + ids[0])
        specs = [wire.TensorSpec("hidden_states", "F32", (t, L, H)), wire.TensorSpec("token_ids", "I64", (t,))]
        data = wire.encode_header(specs, {"layer_ids": "[1,2,3,4]"}) + hs.tobytes() + np.asarray(ids, np.int64).tobytes()
        if self.malformed:
            data = data[:-3]
        return httpx.Response(200, content=data, headers={"Content-Type": wire.MEDIA_TYPE})


N = 24


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "in.jsonl"
    rows = [{"input_ids": [i, i + 1, i + 2][: 1 + i % 3]} for i in range(N)] + [{"text": "bad row"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def cfg_for(data, out, **kw):
    connection = {k: kw.pop(k) for k in list(kw) if k in ClientSettings.model_fields}
    base = dict(
        client=ClientSettings.given(["http://s1", "http://s2"], **{
            "concurrency_per_server": 3, "max_attempts": 3, "unhealthy_cooldown": 0.05, **connection}),
        output=out, inputs=[str(data)], format="fake", seed=7, quiet=True, write_workers=3,
    )
    base.update(kw)
    return ex.ExtractConfig(**base)


def run(cfg, fmt, server):
    return ex.run_extract(cfg, hooks(fmt), transport=httpx.MockTransport(server))


def manifest_done(out):
    entries, _, _ = journal.read_jsonl(out / store.MANIFEST_NAME)
    return journal.latest_by_index(entries), entries
