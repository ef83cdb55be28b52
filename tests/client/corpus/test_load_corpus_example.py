"""docs/examples/load_corpus.py, the documented recipe for loading a corpus with the trainers'
own readers (issue 36.9: a newcomer had copied it from the test helpers), run on small
corpora the format writers make from fake states (no engine): every sample comes back
equal to what was written, through speculators 0.9 and SpecForge 0.2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, make_decoded, write_samples
from _server import REPO
from hsx_client.corpus.formats import CorpusContext, get_format
from hsx_client.postnorm import FinalNorm, apply_final_norm

EXAMPLE = REPO / "docs" / "examples" / "load_corpus.py"
LENGTHS = [7, 33, 1, 64]


def load_example():
    spec = importlib.util.spec_from_file_location("load_corpus_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_corpus(out: Path, name: str, tokens_only: bool = False, **options: str):
    ctx = CorpusContext(layer_ids=list(LAYER_IDS), hidden_size=HIDDEN, dtype="bfloat16",
                        final_norm=FinalNorm(weight=np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32), eps=1e-5,
                                             style="rms"),
                        draft_vocab_size=32, vocab_size=VOCAB, mask_policy="per_turn")
    fmt = get_format(name, **options)
    decoded = {i: make_decoded(1000 + i, t) for i, t in enumerate(LENGTHS)}
    write_samples(fmt, out, ctx, decoded, tokens_only=tokens_only)
    return decoded, ctx


def test_the_speculators_recipe_reads_every_row_as_written(tmp_path, capsys):
    pytest.importorskip("speculators.train.data", reason="speculators 0.9 not installed")
    decoded, _ = write_corpus(tmp_path, "speculators")
    example = load_example()
    rows = list(example.speculators_rows(tmp_path, 4096))
    assert len(rows) == len(LENGTHS)
    for row, d in zip(rows, decoded.values()):
        assert torch.equal(row["input_ids"], torch.from_numpy(d.token_ids))
        assert torch.equal(row["loss_mask"], torch.from_numpy(d.loss_mask.astype(np.int64)))
        assert torch.equal(row["hidden_states"], d.hidden_states[:, :3].flatten(1))
        assert torch.equal(row["verifier_last_hidden_states"], d.hidden_states[:, 3])
    assert example.main([str(tmp_path), "--show", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"row 0: {LENGTHS[0]} tokens, {int(decoded[0].loss_mask.sum())} supervised;")
    assert f"hidden_states [{LENGTHS[0]}, {3 * HIDDEN}]" in out[0]
    assert out[-1] == f"speculators: {len(LENGTHS)} samples read from {tmp_path}"


def test_the_speculators_recipe_reads_fp8_and_refuses_a_token_table(tmp_path):
    pytest.importorskip("hs_connectors", reason="hs-connectors 0.9 not installed")
    pytest.importorskip("speculators.train.data", reason="speculators 0.9 not installed")
    example = load_example()
    decoded, _ = write_corpus(tmp_path / "fp8", "speculators", dtype="fp8")
    rows = list(example.speculators_rows(tmp_path / "fp8", 4096))
    for row, d in zip(rows, decoded.values()):
        got = row["verifier_last_hidden_states"].float()
        want = d.hidden_states[:, 3].float()
        assert torch.equal(row["input_ids"], torch.from_numpy(d.token_ids))
        assert ((got - want).norm() / want.norm()).item() < 0.05  # e4m3 with a per-token scale
    write_corpus(tmp_path / "none", "speculators", tokens_only=True, states="none")
    with pytest.raises(SystemExit, match="holds no states.*--hidden-states-backend hsx"):
        list(example.speculators_rows(tmp_path / "none", 4096))


def test_the_specforge_recipe_reads_every_sample_as_written(tmp_path, capsys):
    pytest.importorskip("specforge", reason="specforge 0.2.0 not installed")
    decoded, ctx = write_corpus(tmp_path, "specforge")
    example = load_example()
    batches = list(example.specforge_batches(tmp_path, 4096))
    assert len(batches) == len(LENGTHS)
    for _, t in batches:
        i = next(i for i, d in decoded.items() if torch.equal(t["input_ids"][0], torch.from_numpy(d.token_ids)))
        hs = decoded[i].hidden_states
        assert torch.equal(t["hidden_state"][0], hs[:, :3].reshape(len(hs), 3 * HIDDEN))
        assert torch.equal(t["target"][0], apply_final_norm(hs[:, 3], ctx.final_norm))
        mask = torch.from_numpy(decoded[i].loss_mask.astype(np.int64))
        assert torch.equal(t["loss_mask"][0][:-1], mask[:-1]) and t["loss_mask"][0][-1] == 0
    assert example.main([str(tmp_path), "--show", "0"]) == 0
    assert capsys.readouterr().out.strip() == f"specforge: {len(LENGTHS)} samples read from {tmp_path}"


def test_an_unfinished_corpus_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no finished hsx corpus"):
        load_example().main([str(tmp_path)])


@pytest.mark.slow  # a fresh interpreter importing speculators: seconds
def test_the_example_runs_as_a_script(tmp_path):
    pytest.importorskip("speculators.train.data", reason="speculators 0.9 not installed")
    write_corpus(tmp_path, "speculators")
    r = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path), "--max-len", "512"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == f"speculators: {len(LENGTHS)} samples read from {tmp_path}"
