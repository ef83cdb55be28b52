"""Issue 38 end to end: the image-chat fixture (tests/_image_chats.py: photographs and a scan
from matplotlib's sample data, questions and answers of ours) in its three input shapes
(OpenAI messages with relative paths and a data URI, LLaVA rows, a dataset with an image
column) through `hsx extract` against one real `hsx serve` of a tiny Kimi-K2.5, `hsx verify`,
and both trainers' own readers: speculators' ArrowDataset and SpecForge's offline eagle3
reader. Every image's tokens are in the corpus as the target's image token id, marked by the
media mask, never supervised; a sample's states are the server's for the same chat, and so
are those the online `hsx` backend fetches for a `--states none` table's image rows."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

import _image_chats as chats
from _corpus_helpers import specforge_rows
from _e2e_helpers import assert_verify_ok, run_extract

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    root = chats.write_fixture(tmp_path_factory.mktemp("image-chats"))
    return [str(root / "openai.jsonl"), str(root / "llava.json"), str(chats.hf_dataset(root))]


@pytest.fixture(scope="module")
def kimi_server(kimi_vl_server):
    return kimi_vl_server  # tests/conftest.py: shared with tests/service/engine/test_images.py


def _expected_samples(policy: str) -> int:
    per_turn = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in chats.openai_rows())
    rows = len(chats.openai_rows())
    return (per_turn if policy == "per_turn" else rows) + 2 * len(chats.QA)


def _check_media(ids: np.ndarray, media: np.ndarray, loss: np.ndarray, image_token: int) -> None:
    assert (ids[media.astype(bool)] == image_token).all()
    assert int((ids == image_token).sum()) == int(media.sum())
    assert not (media.astype(bool) & loss.astype(bool)).any() and loss.any()


def test_image_chats_make_a_speculators_corpus_its_reader_loads(kimi_server, inputs, tmp_path):
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9 not installed")
    out = tmp_path / "speculators"
    s = run_extract([kimi_server], out, "--format", "speculators", *sum((["--input", p] for p in inputs), []),
                    timeout=900)
    assert s["status"] == "complete" and s["done"] == _expected_samples("per_turn"), s
    facts = json.loads((out / "hsx_format.json").read_text())
    assert facts["num_media_tokens"] > 0
    assert_verify_ok(out)
    ds = data.ArrowDataset(4096, str(out), on_missing="raise", train_ratio=1.0)
    table = ds.data.with_format(None)
    assert len(ds) == s["done"]
    for i in range(len(ds)):
        row = ds[i]  # speculators drops a row whose file's ids differ from the table's: it must not
        assert isinstance(row, dict), f"speculators could not load row {i}: {row}"
        _check_media(row["input_ids"].numpy(), np.array(table[i]["media_mask"]), row["loss_mask"].numpy(),
                     kimi_server.image_token_id)
    assert sum(sum(table[i]["media_mask"]) for i in range(len(ds))) == facts["num_media_tokens"]
    # every sample shows an image but one: the first turn of the chat whose image comes in its second
    assert sum(1 for i in range(len(ds)) if any(table[i]["media_mask"])) == len(ds) - 1


def test_image_chats_make_a_specforge_corpus_its_reader_loads(kimi_server, inputs, tmp_path):
    pytest.importorskip("specforge", reason="SpecForge 0.2 not installed")
    out = tmp_path / "specforge"
    s = run_extract([kimi_server], out, "--format", "specforge", "--mask-policy", "all_turns",
                    *sum((["--input", p] for p in inputs), []), timeout=900)
    assert s["status"] == "complete" and s["done"] == _expected_samples("all_turns"), s
    assert_verify_ok(out)
    records = {e["index"]: e["record"] for e in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    rows = specforge_rows(out, "eagle3")
    assert len(rows) == s["done"]
    for i, t in rows.items():
        media = np.repeat(np.arange(len(records[i]["media_runs"])) % 2, records[i]["media_runs"])
        n = len(media)
        assert media.any(), "under all_turns every sample holds its chat's images"
        _check_media(t["input_ids"].reshape(-1)[:n].numpy(), media, t["loss_mask"].reshape(-1)[:n].numpy(),
                     kimi_server.image_token_id)


def test_a_corpus_sample_holds_the_servers_states_for_its_chat(kimi_server, inputs, tmp_path):
    """The LLaVA row's photograph read from its path and sent by extract as a data URI gives
    the states the server gives the same chat with the image inline."""
    from safetensors.torch import load as st_load
    from safetensors.torch import load_file

    out = tmp_path / "one"
    run_extract([kimi_server], out, "--format", "speculators", "--input", inputs[1], "--max-samples", "1",
                "--no-shuffle", timeout=600)
    (img, question, answer) = chats.QA[0]
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": chats.data_uri(img)}},
                                         {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer}]
    r = httpx.post(kimi_server.url + "/hidden_states", json={"messages": chat, "assistant_mask": "last"},
                   headers={"Accept-Encoding": "identity"}, timeout=300)
    assert r.status_code == 200, r.text
    want = st_load(r.content)
    got = load_file(str(out / "hidden_states" / "hs_0.safetensors"))
    assert torch.equal(got["token_ids"], want["token_ids"])
    assert torch.equal(got["hidden_states"], want["hidden_states"])


def test_a_token_table_of_image_chats_gives_the_online_backend_their_states(kimi_server, inputs, tmp_path):
    """`--states none` of the OpenAI rows (images by relative path and as a data URI, two in one
    chat, one chat with a text-only first turn): every image row stores its request, and the
    `hsx` backend, posting it (the text row: its ids), gets the states a `--states all` extract
    of the same chats stored, row for row."""
    pytest.importorskip("hs_connectors", reason="speculators' hs_connectors is not installed")
    from safetensors.torch import load_file

    from hsx_client.training.speculators_backend import HsxSettings, HsxTransfer

    args = ["--format", "speculators", "--input", inputs[0], "--no-shuffle"]
    full, tokens = tmp_path / "full", tmp_path / "tokens"
    run_extract([kimi_server], full, *args, timeout=600)
    s = run_extract([kimi_server], tokens, *args, "--states", "none", timeout=600)
    turns = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in chats.openai_rows())
    assert s["status"] == "complete" and s["done"] == turns, s
    assert_verify_ok(tokens)
    assert len(list(tokens.glob("token_ids/request_*.json"))) == s["done"] - 1  # all but the text-only turn
    t = HsxTransfer(HsxSettings(servers=(kimi_server.url,), data_path=str(tokens), transfer="http", on_missing="raise"))
    worst = 0.0
    try:
        for i in range(s["done"]):
            got, want = t.get_cached(i), load_file(str(full / "hidden_states" / f"hs_{i}.safetensors"))
            assert torch.equal(got["token_ids"], want["token_ids"]), i
            assert got["hidden_states"].dtype == want["hidden_states"].dtype, i
            a, b = got["hidden_states"].float(), want["hidden_states"].float()
            worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item())
    finally:
        t.close()
    # the same server, model and chats: in fp32 equal to float noise; bf16 (an AMX CPU) to its rounding
    assert worst <= (1e-5 if chats.kimi_dtype() == "float32" else 1e-2), worst


def test_regenerated_image_chats_extract_into_a_verified_corpus(kimi_server, inputs, tmp_path):
    """`hsx regenerate` on the LLaVA rows (each answer generated by the target, looking at its
    image), then `hsx extract` of its output. Skips, saying so, while the server's
    /v1/chat/completions takes no images (the service side of issue 38)."""
    import subprocess

    from _e2e_helpers import HSX, cli_env

    out = tmp_path / "regen.jsonl"
    argv = [*HSX, "regenerate", "--server", kimi_server.url, "--input", inputs[1], "--output", str(out),
            "--max-tokens", "8", "--json", "--quiet"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=cli_env())
    summary = json.loads(next((x for x in r.stdout.splitlines() if x.startswith("{")), "{}"))
    if r.returncode == 2 and "refuses image chats" in summary.get("error", ""):
        pytest.skip(f"this server's /v1/chat/completions takes no images yet: {summary['error'][:200]}")
    assert r.returncode == 0 and summary["regenerated"] == len(chats.QA), (r.returncode, summary, r.stderr[-2000:])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        (turn,) = row["hsx_turns"]
        assert turn["prompt_token_ids"].count(kimi_server.image_token_id) > 4  # the image, expanded, in its prompt
    corpus = tmp_path / "corpus"
    s = run_extract([kimi_server], corpus, "--format", "speculators", "--input", str(out), timeout=600)
    assert s["status"] == "complete" and s["done"] == len(chats.QA), s
    assert_verify_ok(corpus)
