"""Corpus writers, loaded back through the trainers' own readers (speculators, SpecForge)."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_client.corpus import store
from hsx_client.corpus.formats import (
    CorpusContext,
    CorpusFormatError,
    get_format,
    mask_to_runs,
    runs_to_mask,
)
from hsx_client.postnorm import FinalNorm, apply_final_norm
from hsx_client.corpus.vocab import build_mappings

from _corpus_helpers import FIXTURES, HIDDEN, LAYER_IDS, VOCAB, make_decoded, specforge_batches, store_files

LENGTHS = [7, 33, 1, 120, 64, 5, 18]


def _ctx(style="rms", draft=32, dtype="bfloat16", policy="per_turn"):
    w = np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32)
    return CorpusContext(
        layer_ids=list(LAYER_IDS), hidden_size=HIDDEN, dtype=dtype,
        final_norm=FinalNorm(weight=w, eps=1e-5, style=style),
        draft_vocab_size=draft, vocab_size=VOCAB, mask_policy=policy,
    )


def _write_corpus(fmt, out: Path, ctx, lengths=LENGTHS, skip=()):
    """Plan indices 0..n-1 (shuffled write order), write all but `skip`, return decoded+records."""
    decoded = {i: make_decoded(1000 + i, t) for i, t in enumerate(lengths)}
    order = list(decoded)
    random.Random(0).shuffle(order)
    records = []
    for i in order:
        so = fmt.encode_sample(i, decoded[i], ctx)
        json.dumps(so.record)  # must be JSON-able
        if i in skip:
            continue
        store_files(out, so.files)
        records.append((i, so.record))
    return decoded, records


def _supervised_counts(decoded, indices):
    c: Counter = Counter()
    for i in indices:
        d = decoded[i]
        c.update(d.token_ids[d.loss_mask.astype(bool)].tolist())
    return c


# ----------------------------------------------------------------------------- unit pieces


def test_mask_runs_roundtrip():
    for m in ([], [0], [1], [0, 0, 1, 1, 0, 1], [1, 1, 1], [1, 0, 0, 1]):
        a = np.array(m, dtype=np.uint8)
        runs = mask_to_runs(a)
        assert runs_to_mask(runs).tolist() == m
        assert sum(runs) == len(m)


@pytest.mark.parametrize("style", ["rms", "gemma"])
def test_apply_final_norm_matches_reference(style):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(5, 9, HIDDEN) * 4
    w = np.random.default_rng(0).normal(size=HIDDEN).astype(np.float32)
    ref = LlamaRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w + (1.0 if style == "gemma" else 0.0)))
    got = apply_final_norm(x, FinalNorm(w, 1e-6, style))
    torch.testing.assert_close(got, ref(x), rtol=1e-6, atol=1e-6)
    xb = x.to(torch.bfloat16)
    yb = apply_final_norm(xb, FinalNorm(w, 1e-6, style))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), ref(xb.float()), rtol=1e-2, atol=2e-2)


@pytest.mark.fixtures
def test_final_norm_reproduces_a_real_model():
    """stories260K: norm(last layer pre-norm) == transformers' post-norm last hidden state."""
    model_dir = FIXTURES / "models" / "stories260K"
    if not model_dir.is_dir():
        pytest.skip(f"model fixture not found at {model_dir} (../shared/fixtures is absent)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.setdefault(
        "pre", out[0] if isinstance(out, tuple) else out))
    ids = torch.tensor([[1, 400, 300, 200, 100, 50, 7]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hook.remove()
    norm = FinalNorm(model.model.norm.weight.detach().numpy(), model.config.rms_norm_eps, "rms")
    torch.testing.assert_close(apply_final_norm(captured["pre"], norm), out.hidden_states[-1], rtol=1e-5, atol=1e-5)


def test_encode_rejects_mismatches():
    ctx = _ctx()
    for name in ("speculators", "specforge"):
        f = get_format(name)
        with pytest.raises(CorpusFormatError, match="4 layers"):
            f.encode_sample(0, make_decoded(1, 8, layer_ids=[1, 2, 5]), ctx)
        with pytest.raises(CorpusFormatError, match="hidden size"):
            f.encode_sample(0, make_decoded(1, 8, hidden=32), ctx)
        with pytest.raises(CorpusFormatError, match="vocab"):
            f.encode_sample(0, make_decoded(1, 8, vocab=VOCAB * 4), CorpusContext(
                list(LAYER_IDS), HIDDEN, "bfloat16", ctx.final_norm, None, 16))
    # vocab size not reported: fine without a draft vocab, refused with one
    unknown_v = _ctx(draft=None)
    unknown_v.vocab_size = None
    assert get_format("speculators").encode_sample(0, make_decoded(1, 8), unknown_v).record["num_tokens"] == 8
    unknown_v.draft_vocab_size = 32
    with pytest.raises(CorpusFormatError, match="target vocab size"):
        get_format("speculators").encode_sample(0, make_decoded(1, 8), unknown_v)
    no_norm = _ctx()
    no_norm.final_norm = None
    with pytest.raises(CorpusFormatError, match="final norm"):
        get_format("specforge").encode_sample(0, make_decoded(1, 8), no_norm)
    with pytest.raises(ValueError, match="unknown corpus format"):
        get_format("eagle")


def test_no_mask_means_all_supervised_and_bytes_estimate(tmp_path):
    ctx = _ctx()
    for name in ("speculators", "specforge"):
        f = get_format(name)
        so = f.encode_sample(3, make_decoded(2, 400, mask=None), ctx)
        assert so.record["num_supervised"] == 400 and so.record["mask_source"] == "none"
        size = sum(store.file_size(b) for b in so.files.values())
        est = f.bytes_per_token(ctx) * 400
        assert 0.7 * est < size < 1.3 * est, (name, size, est)


# ----------------------------------------------------------------------------- vocab


def test_vocab_selection_rules():
    freq = {10: 5, 3: 5, 7: 9, 200: 1, 4: 5}
    d2t, t2d = build_mappings(freq, 3, 256)
    # top-3 by frequency, tie (5, 5, 5) broken toward lower ids: 7, then 3 and 4
    assert (np.arange(3) + d2t).tolist() == [3, 4, 7]
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.shape == (256,)
    assert np.flatnonzero(t2d).tolist() == [3, 4, 7]
    # fewer distinct tokens than K: filled with the lowest unused ids
    d2t, t2d = build_mappings({5: 2, 9: 1}, 5, 16)
    assert (np.arange(5) + d2t).tolist() == [0, 1, 2, 5, 9]
    assert t2d.sum() == 5

    sp = pytest.importorskip("speculators.train.vocab_mapping", reason="speculators not installed")
    rng = np.random.default_rng(1)
    freq = {int(t): int(c) for t, c in zip(rng.choice(VOCAB, 300, replace=False), rng.integers(1, 20, 300))}
    for k in (16, 299, 400):
        ref_d2t, ref_t2d = sp.build_vocab_mappings_from_distribution(freq, k, VOCAB)
        d2t, t2d = build_mappings(freq, k, VOCAB)
        assert np.array_equal(d2t, ref_d2t.numpy()) and np.array_equal(t2d, ref_t2d.numpy())


# ----------------------------------------------------------------------------- speculators


def _speculators_dataset(out: Path, max_len=4096):
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9 not installed")
    return data.ArrowDataset(max_len, str(out), on_missing="raise", train_ratio=1.0)


def _check_speculators_row(row, d):
    hs = d.hidden_states
    assert torch.equal(row["input_ids"], torch.from_numpy(d.token_ids))
    assert torch.equal(row["hidden_states"], hs[:, :3].flatten(1))
    assert torch.equal(row["verifier_last_hidden_states"], hs[:, 3])
    assert torch.equal(row["loss_mask"], torch.from_numpy(d.loss_mask.astype(np.int64)))


def test_speculators_corpus_loads_in_speculators(tmp_path):
    ctx = _ctx()
    f = get_format("speculators")
    decoded, records = _write_corpus(f, tmp_path, ctx)
    written = f.finalize(tmp_path, records, ctx)
    assert {"state.json", "dataset_info.json", "token_freq.pt", "d2t-32.npy", "t2d-32.npy",
            "hsx_format.json"} <= set(written)
    assert not (tmp_path / "hsx_compaction.json").exists()
    assert not list(tmp_path.glob(".hsx_finalize*"))

    ds = _speculators_dataset(tmp_path)
    assert len(ds) == len(LENGTHS)
    for i in range(len(ds)):
        row = ds[i]
        assert isinstance(row, dict), f"speculators dropped sample {i}: {row}"
        _check_speculators_row(row, decoded[i])
    assert ds.approx_lengths == LENGTHS

    # the table as speculators' own vocab code would read it
    from datasets import load_from_disk

    table = load_from_disk(str(tmp_path))
    assert table.format["type"] == "torch"
    assert table[0]["loss_mask"].dtype == torch.int64 and table[0]["input_ids"].dtype == torch.int64

    # a collated batch: nothing dropped
    from speculators.train.data import CollateFn

    batch = CollateFn(512, HIDDEN)([ds[i] for i in range(3)])
    assert batch["error_records"] == 0

    # vocab files
    freq = torch.load(tmp_path / "token_freq.pt", weights_only=True)
    assert freq == dict(_supervised_counts(decoded, range(len(LENGTHS))))
    d2t = np.load(tmp_path / "d2t-32.npy")
    t2d = np.load(tmp_path / "t2d-32.npy")
    assert d2t.dtype == np.int64 and d2t.shape == (32,) and t2d.dtype == np.bool_ and t2d.shape == (VOCAB,)
    target = np.arange(32) + d2t
    assert np.array_equal(np.flatnonzero(t2d), target)
    ranked = sorted(freq, key=lambda t: (-freq[t], t))[:32]
    assert target.tolist() == sorted(ranked)
    meta = json.loads((tmp_path / "hsx_format.json").read_text())
    assert meta["mask_policy"] == "per_turn" and meta["num_samples"] == len(LENGTHS)

    # verify
    for i, rec in records:
        assert f.verify_sample(tmp_path, i, rec) == []
    i, rec = records[0]
    bad = dict(rec, ids_crc32=rec["ids_crc32"] ^ 1)
    assert any("crc32" in p for p in f.verify_sample(tmp_path, i, bad))
    p = tmp_path / f.hs_path(i)
    p.write_bytes(p.read_bytes()[:-10])
    assert f.verify_sample(tmp_path, i, rec)
    assert f.verify_sample(tmp_path, 99, rec) == [f"{f.hs_path(99)} is missing"]


def test_speculators_subset_is_compacted_crash_safely(tmp_path, monkeypatch):
    ctx = _ctx(draft=None)
    f = get_format("speculators")
    # 7 planned; 1 and 4 failed (4 even left a complete but unrecorded file behind)
    decoded, records = _write_corpus(f, tmp_path, ctx, skip={1, 4})
    store_files(tmp_path, f.encode_sample(4, decoded[4], ctx).files)
    # m = 5 rows: holes {1, 4} below 5 are filled by the tails {5, 6}

    calls = {"n": 0}
    real_replace = os.replace

    def crashing_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:  # journal written (1), first move done (2), crash on the second
            raise KeyboardInterrupt("simulated crash")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        f.finalize(tmp_path, records, ctx)
    monkeypatch.setattr(os, "replace", real_replace)
    journal = json.loads((tmp_path / "hsx_compaction.json").read_text())
    assert journal["moves"] == [[5, 1], [6, 4]]

    written = f.finalize(tmp_path, records, ctx)  # finishes the compaction
    assert "hsx_compaction.json" in written and "token_freq.pt" in written
    assert not any(n.startswith("d2t") for n in written)
    ds = _speculators_dataset(tmp_path)
    assert len(ds) == 5
    placed = {0: 0, 1: 5, 2: 2, 3: 3, 4: 6}
    for row_i, sample_i in placed.items():
        _check_speculators_row(ds[row_i], decoded[sample_i])
    # a second finalize with the same records is a no-op on the files
    f.finalize(tmp_path, records, ctx)
    assert len(_speculators_dataset(tmp_path)) == 5
    rec_of = dict(records)
    for row_i, sample_i in placed.items():
        assert f.verify_sample(tmp_path, row_i, rec_of[sample_i]) == []
    # a different subset against the recorded journal is refused
    with pytest.raises(CorpusFormatError, match="different compaction"):
        f.finalize(tmp_path, [r for r in records if r[0] != 0], ctx)


# ----------------------------------------------------------------------------- SpecForge


def _specforge_batches(path: Path, max_len=4096):
    pytest.importorskip("specforge", reason="specforge 0.2.0 not installed")
    return specforge_batches(path, max_len)


@pytest.mark.parametrize("style", ["rms", "gemma"])
def test_specforge_corpus_loads_in_specforge(tmp_path, style):
    ctx = _ctx(style=style, policy="all_turns")
    f = get_format("specforge")
    decoded, records = _write_corpus(f, tmp_path, ctx, skip={2})
    # an orphan: complete file whose record never made it to the manifest
    store_files(tmp_path, f.encode_sample(2, decoded[2], ctx).files)
    written = f.finalize(tmp_path, records, ctx)
    assert set(written) == {"vocab_mapping/vocab_mapping.pt", "hsx_format.json"}
    assert (tmp_path / (f.ckpt_path(2) + ".orphan")).exists()

    batches = _specforge_batches(tmp_path)
    assert len(batches) == len(LENGTHS) - 1
    seen = set()
    for path, t in batches:
        i = int(Path(path).name[len("data_"):-len(".ckpt")])
        assert path.endswith(f.ckpt_path(i))
        seen.add(i)
        d = decoded[i]
        hs = d.hidden_states
        n = hs.shape[0]
        assert torch.equal(t["input_ids"], torch.from_numpy(d.token_ids).unsqueeze(0))
        assert torch.equal(t["hidden_state"], hs[:, :3].reshape(n, 3 * HIDDEN).unsqueeze(0))
        assert torch.equal(t["target"], apply_final_norm(hs[:, 3], ctx.final_norm).unsqueeze(0))
        expected_mask = torch.from_numpy(d.loss_mask.astype(np.int64))
        expected_mask[-1] = 0  # SpecForge's normalizer never supervises the last position
        assert torch.equal(t["loss_mask"], expected_mask.unsqueeze(0))
        assert t["attention_mask"].shape == (1, n)
        # post-norm of the last layer, computed independently
        x = hs[:, 3].float()
        w = torch.from_numpy(ctx.final_norm.weight) + (1.0 if style == "gemma" else 0.0)
        ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).to(hs.dtype)
        assert torch.equal(t["target"][0], ref)
    assert seen == set(range(len(LENGTHS))) - {2}

    # raw files: exact dtypes/shapes
    raw = torch.load(tmp_path / f.ckpt_path(3), weights_only=True)
    assert raw["input_ids"].dtype == torch.int64 and raw["loss_mask"].dtype == torch.int64
    assert raw["aux_hidden_state"].shape == (1, LENGTHS[3], 3 * HIDDEN)
    assert raw["hidden_state"].shape == (1, LENGTHS[3], HIDDEN)
    assert raw["hidden_state"].dtype == torch.bfloat16

    vm = torch.load(tmp_path / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    assert vm["d2t"].dtype == torch.int64 and vm["d2t"].shape == (32,)
    assert vm["t2d"].dtype == torch.bool and vm["t2d"].shape == (VOCAB,)
    freq = _supervised_counts(decoded, [i for i, _ in records])
    ranked = sorted(freq, key=lambda t: (-freq[t], t))[:32]
    target = torch.arange(32) + vm["d2t"]
    assert target.tolist() == sorted(ranked)
    assert torch.equal(torch.nonzero(vm["t2d"]).flatten(), target)
    # SpecForge's own counter over the written features agrees with ours
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    assert count_effective_feature_tokens(str(tmp_path)) == freq

    for i, rec in records:
        assert f.verify_sample(tmp_path, i, rec) == []
    i, rec = records[0]
    assert f.verify_sample(tmp_path, i, dict(rec, mask_runs=[rec["num_tokens"]]))
    assert f.verify_sample(tmp_path, i, dict(rec, hidden_size=HIDDEN * 2))
    meta = json.loads((tmp_path / "hsx_format.json").read_text())
    assert meta["mask_policy"] == "all_turns" and meta["orphans_quarantined"] == 1
