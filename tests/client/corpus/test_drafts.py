"""`hsx extract --draft` (issue 39): each draft's layer set, the check of the served layers
before any sample, and the records each format writes for it, read back by the trainers'
own readers (speculators' ArrowDataset, SpecForge's offline providers)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hsx_client.corpus import drafts
from hsx_client.corpus import extract as ex
from hsx_client.corpus.formats import CorpusContext, get_format
from hsx_client.corpus.settings import ConfigError, CorpusSettings
from hsx_client.corpus.stream_write import store_stream
from hsx_client.postnorm import FinalNorm, apply_final_norm

from _corpus_helpers import HIDDEN, VOCAB, DecodedStream, make_decoded, specforge_rows, store_files
from _extract_fakes import FakeCtx, cfg_for, data, fake_read_samples  # noqa: F401  (data: a fixture)
from _first_hour import InfoServer, refused_and_untouched

N = 5  # the layers of the corpus helpers' model (stories260K-like)
ALL = list(range(N + 1))


def ctx_for(layers, draft_vocab=None):
    w = np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32)
    return CorpusContext(layer_ids=list(layers), hidden_size=HIDDEN, dtype="bfloat16",
                         final_norm=FinalNorm(weight=w, eps=1e-5), draft_vocab_size=draft_vocab, vocab_size=VOCAB)


def write(fmt, out: Path, layers, lengths=(9, 30, 17)):
    ctx = ctx_for(layers, draft_vocab=32)
    decoded = {i: make_decoded(50 + i, t, layer_ids=list(layers)) for i, t in enumerate(lengths)}
    records = []
    for i, d in decoded.items():
        so = fmt.encode_sample(i, d, ctx)
        store_files(out, so.files)
        records.append((i, so.record))
    fmt.finalize(out, records, ctx)
    return decoded, records, ctx


# ----------------------------------------------------------------------------- the registry


def test_default_layers_follow_each_trainer():
    n = 32
    assert drafts.default_layers("eagle3", "speculators", n) == [2, 16, 29, 32]
    for d in ("peagle", "dflash", "dspark"):  # speculators' resolve_target_layer_ids default + the last
        assert drafts.default_layers(d, "speculators", n) == [2, 16, 29, 32]
    assert drafts.default_layers("mtp", "speculators", n) == [32]
    # SpecForge's 1-layer DFlash-family draft: its id N//2, hsx id N//2 + 1
    assert drafts.default_layers("dflash", "specforge", n) == [17]
    assert drafts.default_layers("domino", "specforge", n) == [17]
    assert drafts.default_layers("dspark", "specforge", n) == [17, 32]
    # its spread for a 5-layer draft of a 36-layer target: [1, 9, 17, 25, 33] in its ids
    assert drafts.specforge_spread(36, 5) == [2, 10, 18, 26, 34]
    assert drafts.default_layers(None, "specforge", 5) == [1, 2, 3, 5]


@pytest.mark.parametrize("fmt,draft", [("specforge", "mtp"), ("specforge", "peagle"), ("speculators", "domino")])
def test_a_draft_the_trainer_lacks_is_refused_in_one_line(fmt, draft):
    with pytest.raises(ValueError) as e:
        get_format(fmt, draft=draft)
    msg = str(e.value)
    assert f"--draft {draft}" in msg and "--format" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="unknown"):
        drafts.get_draft("medusa")


def test_layer_problems_name_the_flag_and_the_set():
    assert drafts.layer_problem("mtp", "speculators", [32], 32, [2, 16, 29, 32]) is None
    msg = drafts.layer_problem("mtp", "speculators", [2, 16, 29, 32], 32, [2, 16, 29, 32])
    assert "--draft mtp" in msg and "pass --layers 32" in msg
    assert drafts.layer_problem("dflash", "speculators", [1, 9, 17, 25, 34, 36], 36, []) is None  # any K
    msg = drafts.layer_problem("dflash", "specforge", [17, 32], 32, [2, 16, 17, 29, 32])
    assert "must not hold 32" in msg and "pass --layers 17" in msg
    msg = drafts.layer_problem("dspark", "specforge", [2, 16], 32, [2, 16, 29, 32])
    assert "must end with 32" in msg and "restart hsx serve with --layers 17,32" in msg
    assert drafts.layer_problem("peagle", "speculators", [2, 16, 29, 32], 32, []) is None


def test_trainer_layer_ids_are_each_trainers_numbering():
    assert drafts.trainer_layer_ids("dflash", "speculators", [1, 9, 17, 25, 34, 36])["flag"] == \
        "--target-layer-ids 1 9 17 25 34"
    assert drafts.trainer_layer_ids("dspark", "specforge", [17, 32])["target_layer_ids"] == [16]
    assert drafts.trainer_layer_ids("mtp", "speculators", [32]) == {}


# ----------------------------------------------------------------------------- pre-flight


def _hooks():
    return ex.Hooks(read_samples=fake_read_samples, get_format=get_format, make_context=FakeCtx)


def _run(cfg, srv):
    return ex.run_extract(cfg, _hooks(), transport=httpx.MockTransport(srv))


def test_served_layers_that_do_not_fit_the_draft_are_refused_before_any_sample(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer(layer_ids=[1, 2, 3, 4], num_hidden_layers=4)
    r = _run(cfg_for(data, out, format="speculators", draft="mtp"), srv)
    refused_and_untouched(r, out, srv, r"--draft mtp .*pass --layers 4 ")
    r = _run(cfg_for(data, out, format="specforge", draft="domino"), srv)  # its record has no last state
    refused_and_untouched(r, out, srv, r"--draft domino .*must not hold 4.*pass --layers 3 ")


def test_a_draft_its_format_lacks_is_refused_before_any_sample(tmp_path, data):
    out = tmp_path / "out"
    srv = InfoServer()
    r = _run(cfg_for(data, out, format="specforge", draft="mtp"), srv)
    refused_and_untouched(r, out, srv, r"--draft mtp: specforge's trainer does not train MTP")


def test_a_plan_from_before_drafts_is_eagle3_and_refuses_another(tmp_path):
    plan = {"settings": {"format": "speculators", "layers": [1, 2, 3, 5]}}
    assert CorpusSettings.resolve({"draft": None}, plan, tmp_path).draft == "eagle3"
    with pytest.raises(ConfigError, match="--draft: the plan has the default 'eagle3', this run asks 'dflash'"):
        CorpusSettings.resolve({"draft": "dflash"}, plan, tmp_path)


def test_extract_help_lists_every_draft_and_the_flag_parses():
    from hsx_client.corpus.cli import build_extract_parser

    p = build_extract_parser()
    text = p.format_help()
    for d in drafts.DRAFTS:
        assert f"  {d} " in text
    assert p.parse_args(["--output", "x", "--draft", "dspark"]).draft == "dspark"


# ----------------------------------------------------------------------------- speculators


@pytest.mark.parametrize("draft,layers", [("dflash", [0, 1, 2, 3, 4, 5]), ("mtp", [5]), ("peagle", [1, 2, 3, 5])])
@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_speculators_writes_k_plus_one_layers_its_reader_splits(tmp_path, draft, layers, dtype):
    data = pytest.importorskip("speculators.train.data")
    fmt = get_format("speculators", draft=draft, **({"dtype": dtype} if dtype != "auto" else {}))
    decoded, records, _ = write(fmt, tmp_path, layers)
    facts = json.loads((tmp_path / "hsx_format.json").read_text())
    assert facts["draft"] == draft and facts["layer_ids"] == layers
    assert all(fmt.verify_sample(tmp_path, i, rec) == [] for i, rec in records)
    if dtype == "fp8":
        return  # read by speculators' fp8 backend (hs_connectors): tests/client/training
    ds = data.ArrowDataset(4096, str(tmp_path), on_missing="raise", train_ratio=1.0)
    for i, d in decoded.items():
        row = ds[i]
        hs = d.hidden_states
        assert torch.equal(row["hidden_states"], hs[:, :-1].flatten(1))  # K aux (K = 0 for MTP)
        assert torch.equal(row["verifier_last_hidden_states"], hs[:, -1])


def test_the_token_table_takes_any_draft(tmp_path):
    fmt = get_format("speculators", draft="mtp", states="none")
    _, records, _ = write(fmt, tmp_path, [5])
    assert json.loads((tmp_path / "hsx_format.json").read_text())["draft"] == "mtp"
    assert all(fmt.verify_sample(tmp_path, i, rec) == [] for i, rec in records)


# ----------------------------------------------------------------------------- SpecForge


@pytest.mark.parametrize("draft,layers", [("dspark", [1, 2, 3, 5]), ("dflash", [2, 3]), ("domino", [3])])
def test_specforge_records_load_in_specforges_providers(tmp_path, draft, layers):
    fmt = get_format("specforge", draft=draft)
    assert fmt.needs_final_norm == (draft == "dspark")
    decoded, records, ctx = write(fmt, tmp_path, layers)
    assert json.loads((tmp_path / "hsx_format.json").read_text())["trainer_layers"]["target_layer_ids"] == \
        [k - 1 for k in (layers[:-1] if draft == "dspark" else layers)]
    assert all(fmt.verify_sample(tmp_path, i, rec) == [] for i, rec in records)
    pytest.importorskip("specforge")
    rows = specforge_rows(tmp_path, draft)
    assert sorted(rows) == sorted(decoded)
    for i, d in decoded.items():
        hs, t = d.hidden_states, rows[i]
        n_aux = len(layers) - (1 if draft == "dspark" else 0)
        assert torch.equal(t["hidden_states"][0], hs[:, :n_aux].flatten(1))
        if draft == "dspark":
            torch.testing.assert_close(t["target_last_hidden_states"][0], apply_final_norm(hs[:, -1], ctx.final_norm))
        else:
            assert "target_last_hidden_states" not in t


@pytest.mark.parametrize("draft,layers", [("dspark", [1, 2, 3, 5]), ("dflash", [2, 3])])
def test_specforge_streamed_records_equal_the_whole_paths(tmp_path, draft, layers):
    fmt = get_format("specforge", draft=draft)
    ctx = ctx_for(layers)
    d = make_decoded(7, 41, layer_ids=layers)

    async def blocking(fn, *args):
        return await asyncio.to_thread(fn, *args)

    got = asyncio.run(store_stream(tmp_path / "s", fmt, 3, DecodedStream(d, rows=6), ctx, blocking))
    whole = fmt.encode_sample(3, d, ctx)
    store_files(tmp_path / "w", whole.files)
    assert got.record == whole.record
    a = torch.load(tmp_path / "s" / fmt.ckpt_path(3), weights_only=True)
    b = torch.load(tmp_path / "w" / fmt.ckpt_path(3), weights_only=True)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert fmt.verify_sample(tmp_path / "s", 3, got.record) == []


def test_specforge_dflash_family_drops_samples_without_two_supervised_in_a_row():
    fmt = get_format("specforge", draft="dflash")
    assert fmt.drop_reason(np.array([1, 0, 1, 0])) and fmt.drop_reason(np.array([0, 1, 1, 0])) is None
    assert get_format("specforge").drop_reason(np.array([1, 0, 1, 0])) is None  # EAGLE-3's rule is its own


def test_serve_help_states_each_drafts_layer_set():
    """`hsx serve --layers` help (hsx.layers.DRAFT_LAYER_SETS) says what the registry computes."""
    from hsx.layers import DRAFT_LAYER_SETS
    from hsx_service.settings import ServiceSettings

    assert DRAFT_LAYER_SETS in ServiceSettings.model_fields["layers"].description
    for d in drafts.DRAFTS.values():
        for fmt in d.trainers:
            sym = drafts._symbolic(d.name, fmt).split(" ")[0]
            assert sym in DRAFT_LAYER_SETS, (d.name, fmt, sym)
            assert drafts.default_layers(d.name, fmt, 40) == sorted(eval(f"[{sym}]", {"N": 40})), (d.name, fmt)


def test_specforge_dflash_family_cannot_name_the_embeddings():
    msg = drafts.layer_problem("dflash", "specforge", [0, 3], 5, [0, 1, 2, 3, 4, 5])
    assert "ids of 1 or more" in msg and "pass --layers 3 " in msg
    assert drafts.layer_problem("dflash", "speculators", [0, 1, 2, 5], 5, []) is None  # speculators names id 0


def test_an_eagle3_run_on_a_server_capturing_five_layers_is_refused_before_any_sample(tmp_path, data):
    """The issue's example: the default draft, all five served layers taken, refused at once."""
    out = tmp_path / "out"
    srv = InfoServer(layer_ids=[1, 2, 3, 4, 5], num_hidden_layers=5)
    r = _run(cfg_for(data, out, format="speculators"), srv)
    refused_and_untouched(r, out, srv, r"--draft eagle3.*--layers")
