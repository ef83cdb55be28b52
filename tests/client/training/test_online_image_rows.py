"""The online backend serves a token table's image chats (issue 38): a row with a request file
(client/corpus/image_requests.py) is fetched by posting that chat, a text row by its ids, and
every check holds (the server's ids must be the row's). The real HsxClient, table and backend
against a fake server (httpx.MockTransport); a real server: tests/e2e/test_image_chats_e2e.py."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("hs_connectors", reason="speculators' hs_connectors is not installed")

import hsx_client  # noqa: E402
from hsx import wire  # noqa: E402
from hsx_client.corpus.formats import CorpusContext, get_format  # noqa: E402
from hsx_client.training.speculators_backend import HsxSampleError, HsxSettings, HsxTransfer  # noqa: E402

from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, image_chat, text_chat, tokenized, write_samples  # noqa: E402

BODIES = {0: image_chat(0), 1: text_chat(1), 2: image_chat(2)}


class StatesServer:
    """/info and /hidden_states: a chat's ids are those the table holds for it (`ids_of`, by
    its text; `wrong` answers other ids for those chats), an id list's are its own; the states
    a function of the ids, so a test can tell them."""

    def __init__(self, ids_of: dict[str, list[int]]) -> None:
        self.ids_of, self.wrong, self.bodies = ids_of, set(), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/info":
            return httpx.Response(200, json={"model": "tiny", "layer_ids": LAYER_IDS, "hidden_size": HIDDEN})
        body = json.loads(request.content)
        self.bodies.append(body)
        key = json.dumps(body.get("messages"))
        ids = body["input_ids"] if "input_ids" in body else self.ids_of[key][: -1 if key in self.wrong else None]
        hs = states(ids, len(body.get("layers") or LAYER_IDS))
        specs = [wire.TensorSpec("hidden_states", "F32", tuple(hs.shape)), wire.TensorSpec("token_ids", "I64", (len(ids),))]
        data = wire.encode_header(specs, {"layer_ids": json.dumps(body.get("layers") or LAYER_IDS)})
        return httpx.Response(200, content=data + hs.numpy().tobytes() + np.asarray(ids, np.int64).tobytes(),
                              headers={"Content-Type": wire.MEDIA_TYPE})


def states(ids: list[int], layers: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.float32).view(-1, 1, 1) + torch.arange(layers * HIDDEN).view(1, layers, HIDDEN)


@pytest.fixture
def table(tmp_path):
    ctx = CorpusContext(layer_ids=list(LAYER_IDS), hidden_size=HIDDEN, dtype="float32", final_norm=None,
                        draft_vocab_size=32, vocab_size=VOCAB, mask_policy="per_turn")
    decoded = {i: tokenized(400 + i, 10 + 3 * i, b) for i, b in BODIES.items()}
    write_samples(get_format("speculators", states="none"), tmp_path, ctx, decoded, tokens_only=True)
    return tmp_path, {i: d.token_ids.tolist() for i, d in decoded.items()}


REAL_CLIENT = hsx_client.HsxClient


def _transfer(monkeypatch, data, server, **settings) -> HsxTransfer:
    """The backend over `data`, its processes' HsxClient talking to `server`."""
    monkeypatch.setattr(hsx_client, "HsxClient",
                        lambda *a, **k: REAL_CLIENT(*a, transport=httpx.MockTransport(server), compression="none", **k))
    return HsxTransfer(HsxSettings(servers=("http://h:1",), data_path=str(data), transfer="http",
                                   **{"on_missing": "raise", **settings}))


def test_an_image_row_is_fetched_by_its_chat_and_a_text_row_by_its_ids(monkeypatch, table):
    data, ids = table
    server = StatesServer({json.dumps(BODIES[i]["messages"]): ids[i] for i in (0, 2)})
    t = _transfer(monkeypatch, data, server, layers=(1, 2, 5))
    try:
        rows = {i: t.get_cached(i) for i in (0, 1, 2)}
    finally:
        t.close()
    sent = {int(b["id"].split("-")[1]): b for b in server.bodies}
    for i in (0, 2):
        want = {k: v for k, v in BODIES[i].items() if k not in ("id", "layers", "require_supervised")}
        assert sent[i] == {**want, "id": f"row-{i}", "layers": [1, 2, 5]}  # the stored chat, truncation and all
    assert sent[1] == {"input_ids": ids[1], "id": "row-1", "layers": [1, 2, 5]}
    for i, row in rows.items():
        assert row["token_ids"].tolist() == ids[i] and torch.equal(row["hidden_states"], states(ids[i], 3))


def test_an_image_row_the_server_tokenizes_otherwise_is_an_error_naming_it(monkeypatch, table):
    data, ids = table
    server = StatesServer({json.dumps(BODIES[i]["messages"]): ids[i] for i in (0, 2)})
    server.wrong.add(json.dumps(BODIES[2]["messages"]))
    t = _transfer(monkeypatch, data, server)
    try:
        assert t.get_cached(0)["token_ids"].tolist() == ids[0]
        with pytest.raises(HsxSampleError, match=r"row 2 of .*other token ids than the row's .*token_ids/request_2\.json"):
            t.get_cached(2)
    finally:
        t.close()


def test_an_image_row_without_a_readable_request_fails_naming_it(monkeypatch, table):
    data, ids = table
    server = StatesServer({})
    (data / "token_ids/request_2.json").unlink()
    (data / "token_ids/request_0.json").write_text("{")
    t = _transfer(monkeypatch, data, server)
    skip = _transfer(monkeypatch, data, server, on_missing="skip")
    try:
        with pytest.raises(HsxSampleError, match=r"row 2 of .*3 image tokens and no token_ids/request_2\.json"):
            t.get_cached(2)
        with pytest.raises(HsxSampleError, match=r"row 0 of .*request_0\.json is not JSON"):
            t.get_cached(0)
        assert skip.get_cached(2) is None and skip.get_cached(1)["token_ids"].tolist() == ids[1]
    finally:
        t.close()
        skip.close()
    assert [b["id"] for b in server.bodies] == ["row-1"]  # nothing asked for the rows that cannot be
