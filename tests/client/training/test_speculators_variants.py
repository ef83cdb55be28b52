"""The speculators corpus variants (`--states none`, `--dtype fp8`) and the `hsx` backend's
offline parts, against speculators' and hs_connectors' own code; no engine (the online
path with real servers is tests/e2e/test_speculators_online.py)."""

from __future__ import annotations

import argparse
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_client.corpus.formats import CorpusContext, CorpusFormatError, get_format

from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, make_decoded, write_samples

pytest.importorskip("speculators", reason="speculators 0.9 is not installed (scripts/install.sh --test)")
pytest.importorskip("hs_connectors", reason="hs-connectors 0.9 is not installed (scripts/install.sh --test)")

LENGTHS = [7, 33, 1, 120, 64, 5, 18]


def _ctx(dtype="bfloat16"):
    return CorpusContext(layer_ids=list(LAYER_IDS), hidden_size=HIDDEN, dtype=dtype, final_norm=None,
                         draft_vocab_size=32, vocab_size=VOCAB, mask_policy="per_turn")


def _write(fmt, out: Path, ctx, decoded: dict, *, tokens_only=False):
    order = list(decoded)
    random.Random(0).shuffle(order)
    return write_samples(fmt, out, ctx, decoded, order=order, tokens_only=tokens_only)


# ------------------------------------------------------------------ fp8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_quantization_is_hs_connectors_bit_for_bit(dtype):
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    from hsx_client.corpus.formats.speculators_variants import quantize_fp8

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 4, 64, generator=g) * torch.logspace(-3, 3, 50).view(50, 1, 1)).to(dtype)
    x[7] = 0  # an all-zero token: the 1e-12 floor
    q, s = quantize_fp8(x)
    q_ref, s_ref = quantize_tensor_to_fp8(x)
    assert q.dtype == q_ref.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (50, 1, 1)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_fp8_corpus_loads_through_speculators_fp8_backend(tmp_path):
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    ctx = _ctx()
    fmt = get_format("speculators", dtype="fp8")
    decoded = {i: make_decoded(1000 + i, t) for i, t in enumerate(LENGTHS)}
    records = _write(fmt, tmp_path, ctx, decoded)
    bf16 = tmp_path.parent / "bf16"
    _write(get_format("speculators"), bf16, ctx, decoded)

    ds = ArrowDataset(512, str(tmp_path), transfer=FP8Transfer(tmp_path / "hidden_states"), on_missing="raise",
                      train_ratio=1.0)
    for i in range(len(ds)):
        row, hs = ds[i], decoded[i].hidden_states.float()
        assert isinstance(row, dict), f"speculators dropped sample {i}"
        assert row["hidden_states"].dtype == torch.bfloat16
        got = torch.cat([row["hidden_states"].view(-1, 3, HIDDEN), row["verifier_last_hidden_states"].unsqueeze(1)], 1)
        err = ((got.float() - hs).norm() / hs.norm()).item()
        assert err < 0.05, f"sample {i}: relative error {err}"
        assert torch.equal(row["input_ids"], torch.from_numpy(decoded[i].token_ids))
    # same table as the bf16 corpus; about half its state bytes
    assert (tmp_path / "data-00000-of-00001.arrow").read_bytes() == (bf16 / "data-00000-of-00001.arrow").read_bytes()
    size = lambda d: sum(p.stat().st_size for p in (d / "hidden_states").iterdir())  # noqa: E731
    assert 0.45 < size(tmp_path) / size(bf16) < 0.6
    assert fmt.bytes_per_token(ctx) < get_format("speculators").bytes_per_token(ctx) * 0.6
    for i, rec in records:
        assert fmt.verify_sample(tmp_path, i, rec) == []
    i, rec = records[0]
    p = tmp_path / fmt.hs_path(i)
    p.write_bytes(p.read_bytes()[:-3])
    assert fmt.verify_sample(tmp_path, i, rec)


def test_fp8_refuses_non_finite_states():
    d = make_decoded(1, 9)
    d.hidden_states[3, 1, 5] = float("inf")
    with pytest.raises(CorpusFormatError, match="NaN or infinity"):
        get_format("speculators", dtype="fp8").encode_sample(0, d, _ctx())


# ------------------------------------------------------------------ states none


def test_token_table_equals_the_full_corpus_table(tmp_path):
    from datasets import load_from_disk

    ctx = _ctx()
    decoded = {i: make_decoded(2000 + i, t) for i, t in enumerate(LENGTHS)}
    full, tok = tmp_path / "full", tmp_path / "tokens"
    _write(get_format("speculators"), full, ctx, decoded)
    fmt = get_format("speculators", states="none")
    records = _write(fmt, tok, ctx, decoded, tokens_only=True)

    assert not (tok / "hidden_states").exists()
    a, b = load_from_disk(str(full)), load_from_disk(str(tok))
    assert b.format["type"] == "torch" and len(a) == len(b) == len(LENGTHS)
    for i in range(len(a)):
        for col in ("input_ids", "loss_mask", "seq_len"):
            assert torch.equal(a[i][col], b[i][col]), (i, col)
    for name in ("token_freq.pt", "d2t-32.npy", "t2d-32.npy"):
        assert (full / name).read_bytes() == (tok / name).read_bytes(), name
    assert fmt.bytes_per_token(ctx) < 32
    for i, rec in records:
        assert fmt.verify_sample(tok, i, rec) == []
    i, rec = records[2]
    (tok / fmt.hs_path(i)).write_bytes(b"junk")
    assert "unreadable" in fmt.verify_sample(tok, i, rec)[0]

    # speculators' own file backend finds no states in it: the hsx backend is what reads it
    from speculators.train.data import ArrowDataset

    with pytest.raises(RuntimeError, match="Failed to load hidden states"):
        ArrowDataset(512, str(tok), on_missing="raise", train_ratio=1.0)[0]


def test_variants_refuse_what_makes_no_corpus():
    with pytest.raises(ValueError, match="--format speculators only"):
        get_format("specforge", states="none")
    with pytest.raises(ValueError, match="--format speculators only"):
        get_format("specforge", dtype="fp8")
    with pytest.raises(ValueError, match="nothing to apply"):
        get_format("speculators", states="none", dtype="fp8")
    assert type(get_format("speculators", states="all", dtype="auto")).__name__ == "SpeculatorsFormat"


# ------------------------------------------------------------------ the hsx backend, offline parts


def test_backend_flags_resolve_through_speculators_config(tmp_path, monkeypatch):
    from hs_connectors import HiddenStatesBackend

    import hsx_client.training.speculators_backend as sb
    from speculators.train.config import TrainConfig

    key = tmp_path / "key"
    key.write_text("s3cret\n")
    monkeypatch.delenv("HSX_SERVER", raising=False)
    monkeypatch.delenv("HSX_API_KEY", raising=False)
    argv = ["--verifier-name-or-path", "x", "--data-path", str(tmp_path), "--hidden-states-backend", "hsx",
            "--hsx-servers", "http://a:1, http://b:2", "--hsx-layers", "5,1,2,4", "--hsx-api-key-file", str(key),
            "--hsx-transfer", "http", "--on-missing", "warn"]
    cfg = TrainConfig.resolve(argv)
    args = argparse.Namespace(**cfg.flatten())
    t = HiddenStatesBackend.registry["hsx"].from_train_args(args, args.data_path)
    assert t.settings == sb.HsxSettings(servers=("http://a:1", "http://b:2"), data_path=str(tmp_path),
                                        api_key="s3cret", timeout=600.0, max_attempts=10, transfer="http",
                                        layers=(1, 2, 4, 5), on_missing="warn")
    assert "s3cret" not in cfg.dump_yaml()
    # what DataLoader workers receive: settings only, no client, loop or table
    clone = pickle.loads(pickle.dumps(t))
    assert clone.settings == t.settings and clone._rt is None

    bare = argparse.Namespace(**TrainConfig.resolve(argv[:6]).flatten())
    defaults = sb.settings_from_args(argparse.Namespace(**{**vars(bare), "hsx_servers": "http://a:1"}), "d")
    assert defaults.on_missing == "generate" and defaults.layers is None and defaults.transfer == "auto"
    assert defaults.api_key is None
    monkeypatch.setenv("HSX_SERVER", "http://env:3")
    monkeypatch.setenv("HSX_API_KEY", "envkey")
    env = sb.settings_from_args(bare, "d")
    assert env.servers == ("http://env:3",) and env.api_key == "envkey"
    monkeypatch.delenv("HSX_SERVER")
    with pytest.raises(ValueError, match="needs --hsx-servers"):
        sb.settings_from_args(bare, "d")
    with pytest.raises(ValueError, match="--hsx-api-key-file"):
        sb.settings_from_args(argparse.Namespace(hsx_servers="http://a:1", hsx_api_key_file=str(tmp_path / "no")), "d")
    with pytest.raises(ValueError):
        HiddenStatesBackend.registry["hsx"].build_kv_transfer_config(args)
    # a speculators YAML config: the backend's flags under `backend:`, as its own run.yaml writes them
    (tmp_path / "run.yaml").write_text(cfg.dump_yaml())
    again = TrainConfig.resolve(["--config", str(tmp_path / "run.yaml")])
    assert sb.settings_from_args(argparse.Namespace(**again.flatten()), str(tmp_path)).servers == t.settings.servers


def test_wrapper_refuses_missing_servers_before_building_a_model(tmp_path, monkeypatch, capsys):
    from hsx_client.training import speculators_train

    monkeypatch.delenv("HSX_SERVER", raising=False)
    capsys.readouterr()  # drop the table writer's progress bars
    rc = speculators_train.main(["--verifier-name-or-path", "x", "--data-path", str(tmp_path),
                                 "--hidden-states-backend", "hsx"])
    assert rc == 2
    assert "needs --hsx-servers" in capsys.readouterr().err


def test_sample_checks():
    from hsx_client.training.speculators_backend import check_sample

    ids = np.arange(6, dtype=np.int64)
    hs = torch.zeros(6, 4, 8)
    check_sample(hs, torch.from_numpy(ids), ids, 4)
    with pytest.raises(ValueError, match="other token ids"):
        check_sample(hs, torch.from_numpy(ids[::-1].copy()), ids, 4)
    with pytest.raises(ValueError, match="shape"):
        check_sample(hs[:, :3], torch.from_numpy(ids), ids, 4)
    bad = hs.clone()
    bad[2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity"):
        check_sample(bad, torch.from_numpy(ids), ids, 4)


def test_backend_refuses_an_older_table_of_image_chats_at_start(tmp_path, monkeypatch, capsys):
    """Token ids cannot carry an image's pixels: a table of image chats whose rows carry no
    request (made by an hsx before the request files) would train on states of placeholders
    embedded as text, so it is refused before anything is built. One made now is not."""
    import dataclasses
    import json

    import hsx_client.training.speculators_backend as sb
    from hsx_client.training import speculators_train

    decoded = {}
    for i, t in enumerate(LENGTHS[:3]):
        d = make_decoded(3000 + i, t)
        media = np.zeros(t, dtype=np.uint8)
        if i == 1:  # the first unsupervised tokens stand for an image
            media[np.flatnonzero(d.loss_mask == 0)[:4]] = 1
        decoded[i] = dataclasses.replace(d, media_mask=media)
    text, image = tmp_path / "text", tmp_path / "image"
    fmt = get_format("speculators", states="none")
    _write(fmt, text, _ctx(), {i: dataclasses.replace(d, media_mask=None) for i, d in decoded.items()}, tokens_only=True)
    _write(fmt, image, _ctx(), decoded, tokens_only=True)

    args = argparse.Namespace(hsx_servers="http://a:1")
    assert sb.settings_from_args(args, str(text)).data_path == str(text)
    assert sb.settings_from_args(args, str(image)).data_path == str(image)  # its image rows have their requests
    facts = json.loads((image / "hsx_format.json").read_text())
    del facts["image_requests"]  # as an older hsx wrote it
    (image / "hsx_format.json").write_text(json.dumps(facts))
    with pytest.raises(ValueError, match=r"holds image chats \(4 image tokens\) without their requests.*--states all"):
        sb.settings_from_args(args, str(image))
    (image / "hsx_format.json").unlink()  # the table's own media_mask column says it too
    with pytest.raises(ValueError, match="holds image chats"):
        sb.settings_from_args(args, str(image))

    monkeypatch.delenv("HSX_SERVER", raising=False)
    capsys.readouterr()  # drop the table writer's progress bars
    rc = speculators_train.main(["--verifier-name-or-path", "x", "--data-path", str(image),
                                 "--hidden-states-backend", "hsx", "--hsx-servers", "http://a:1"])
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hsx_client")]
    assert rc == 2 and len(ours) == 1 and "holds image chats" in ours[0]
