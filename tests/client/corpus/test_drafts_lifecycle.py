"""Issue 39: a corpus of a non-EAGLE draft goes through every step an EAGLE-3 corpus does:
`hsx verify`, a repair by the next `hsx extract`, `hsx merge` of shards, the `--dtype fp8` and
`--states none` variants, and the online `hsx` backend of speculators. Without an engine: the
real client, formats, merge and verify against the in-process fake server of _shard_helpers
(its states a pure function of the token ids and layer), speculators' own reader on the result.
The drafts: speculators' DFlash with K = 5 aux layers + the last ([T, 6, H] per sample) and
SpecForge's DSpark (hidden_states + target_last_hidden_states)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from hsx_client.corpus.formats import get_format
from hsx_client.corpus.merge import run_merge
from hsx_client.corpus.verify import verify_corpus

from _shard_helpers import FakeHsx, extract, write_inputs

N = 6  # the fake model's decoder layers
CASES = {  # (format, draft) -> the served layers, the run's settings
    ("speculators", "dflash"): ([1, 2, 3, 4, 5, 6], dict(mask_policy="per_turn")),  # K = 5
    ("specforge", "dspark"): ([2, 4, 6], dict(mask_policy="all_turns")),  # SpecForge ids 1, 3 + the last
}
SETTINGS = dict(seed=3, max_samples=12, draft_vocab_size=8)


def server_for(layers: list[int]) -> FakeHsx:
    return FakeHsx(layer_ids=layers, num_hidden_layers=N)


def make(out: Path, inputs: Path, fmt: str, draft: str, shard=None, **kw):
    layers, settings = CASES[(fmt, draft)]
    return extract(out, inputs, fmt=fmt, draft=draft, server=server_for(layers), shard=shard,
                   **settings, **SETTINGS, **kw)


def sample_file(fmt: str, draft: str, index: int, **variant) -> str:
    f = get_format(fmt, draft=draft, **variant)
    return f.hs_path(index) if fmt == "speculators" else f.ckpt_path(index)


@pytest.fixture
def inputs(tmp_path) -> Path:
    return write_inputs(tmp_path / "in.jsonl", 16)


def assert_draft_recorded(out: Path, fmt: str, draft: str) -> None:
    facts = json.loads((out / "hsx_format.json").read_text())
    assert facts["draft"] == draft and facts["layer_ids"] == CASES[(fmt, draft)][0]
    assert json.loads((out / "plan.json").read_text())["settings"]["draft"] == draft


@pytest.mark.parametrize("fmt,draft", list(CASES))
def test_verify_names_a_damaged_sample_and_the_next_extract_repairs_it(tmp_path, inputs, fmt, draft):
    out = tmp_path / "corpus"
    make(out, inputs, fmt, draft)
    assert_draft_recorded(out, fmt, draft)
    assert verify_corpus(out)["ok"]
    victim = out / sample_file(fmt, draft, 4)
    good = victim.read_bytes()
    bad = bytearray(good)
    bad[-3] ^= 0xFF
    victim.write_bytes(bytes(bad))
    report = verify_corpus(out)
    assert not report["ok"] and [b["index"] for b in report["bad"]] == [4], report
    make(out, inputs, fmt, draft)  # the repair: exactly that sample again, the draft's record
    assert victim.read_bytes() == good and verify_corpus(out)["ok"]
    assert_draft_recorded(out, fmt, draft)


@pytest.mark.parametrize("fmt,draft", list(CASES))
def test_shards_merge_into_the_single_clients_corpus(tmp_path, inputs, fmt, draft):
    single = tmp_path / "single"
    make(single, inputs, fmt, draft)
    shards = [tmp_path / f"s{i}" for i in range(2)]
    for i, d in enumerate(shards):
        make(d, inputs, fmt, draft, shard=(i, 2))
    out = tmp_path / "merged"
    r = run_merge(out, shards)
    assert r.exit_code == 0, r.summary
    assert verify_corpus(out)["ok"]
    assert (out / "hsx_format.json").read_bytes() == (single / "hsx_format.json").read_bytes()
    for i in range(SETTINGS["max_samples"]):
        rel = sample_file(fmt, draft, i)
        assert (out / rel).read_bytes() == (single / rel).read_bytes(), rel


def test_shards_of_two_drafts_do_not_merge(tmp_path, inputs):
    a, b = tmp_path / "a", tmp_path / "b"
    make(a, inputs, "speculators", "dflash", shard=(0, 2))
    layers, settings = CASES[("speculators", "dflash")]  # the same layers, another draft
    extract(b, inputs, fmt="speculators", draft="peagle", server=server_for(layers), shard=(1, 2), **settings, **SETTINGS)
    r = run_merge(tmp_path / "merged", [a, b])
    assert r.exit_code == 2 and not (tmp_path / "merged" / "hsx_format.json").exists()
    assert "draft" in json.dumps(r.summary), r.summary


def _rows(out: Path, **kw) -> list[dict]:
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(4096, str(out), on_missing="raise", train_ratio=1.0, **kw)
    return [ds[i] for i in range(len(ds))]


def test_fp8_dflash_corpus_reads_as_k_aux_plus_the_last_through_speculators_fp8_backend(tmp_path, inputs):
    pytest.importorskip("speculators")
    from hs_connectors import FP8Transfer

    full, fp8 = tmp_path / "full", tmp_path / "fp8"
    make(full, inputs, "speculators", "dflash")
    make(fp8, inputs, "speculators", "dflash", dtype="fp8")
    assert verify_corpus(fp8)["ok"]
    want, got = _rows(full), _rows(fp8, transfer=FP8Transfer(fp8 / "hidden_states"))
    assert len(got) == len(want) == SETTINGS["max_samples"]
    for g, w in zip(got, want):
        assert g["hidden_states"].shape == w["hidden_states"].shape and w["hidden_states"].shape[1] == 5 * 16
        err = (g["hidden_states"].float() - w["hidden_states"].float()).norm() / w["hidden_states"].float().norm()
        assert err < 0.05
        torch.testing.assert_close(g["verifier_last_hidden_states"].float(), w["verifier_last_hidden_states"].float(),
                                   rtol=0.07, atol=0.07)


def test_the_online_backend_serves_a_dflash_token_table_as_the_full_corpus(tmp_path, inputs, monkeypatch):
    """`--states none --draft dflash`: the `hsx` backend fetches each row's K + 1 layers from the
    server (the corpus's layers, hsx_corpus.json) and speculators' reader splits them as it
    splits the full corpus's files: the same rows."""
    pytest.importorskip("speculators")
    import hsx_client
    from hsx_client.training.speculators_backend import HsxSettings, HsxTransfer

    full, table = tmp_path / "full", tmp_path / "table"
    make(full, inputs, "speculators", "dflash")
    make(table, inputs, "speculators", "dflash", states="none")
    assert verify_corpus(table)["ok"] and not (table / "hidden_states").exists()
    assert_draft_recorded(table, "speculators", "dflash")
    server = server_for(CASES[("speculators", "dflash")][0])
    real = hsx_client.HsxClient
    monkeypatch.setattr(hsx_client, "HsxClient",
                        lambda *a, **kw: real(*a, **{**kw, "transfer": "http"}, transport=httpx.MockTransport(server)))
    transfer = HsxTransfer(HsxSettings(servers=("http://fake",), data_path=str(table), transfer="http"))
    try:
        got = _rows(table, transfer=transfer)
    finally:
        transfer.close()
    want = _rows(full)
    assert len(got) == len(want) == SETTINGS["max_samples"]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), k
