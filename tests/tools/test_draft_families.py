"""bench/draft_families.py's short version (issue 39): one draft beyond EAGLE-3 per trainer,
and SpecForge's EAGLE-3 (its Triton loss under Triton's interpreter, its target head from the
index.json the bench gives the fixture), trained from an hsx corpus of the fixture model's
states by the trainer's own model and loss on the CPU; the loss falls. The full run's
record: bench/results-cpu-*-draft-families.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import draft_families  # noqa: E402


@pytest.mark.slow
# SpecForge's EAGLE-3 takes seconds a step on the CPU (each token one interpreted Triton
# program): 4 samples, each trained twice, its loss compared sample by sample (falls)
@pytest.mark.parametrize("trainer,draft,steps,samples", [("speculators", "dspark", 12, 16), ("specforge", "dflash", 12, 16),
                                                         ("specforge", "eagle3", 8, 4)])
def test_a_draft_trains_from_an_hsx_corpus(tmp_path, trainer, draft, steps, samples):
    pytest.importorskip(trainer)
    if not draft_families.MODEL.exists():
        pytest.skip("the shared fixture model is not here")
    (run,) = draft_families.run([(trainer, draft)], steps=steps, samples=samples, work=tmp_path)
    assert run["layers"] and len(run["loss"]) == steps
    assert run["falls"], run["loss"]


def test_falls_compares_each_cycled_batch_with_itself():
    loss = [9, 1, 5, 8, 0.5, 4]  # three samples of other difficulty, each better the second time
    assert draft_families.falls(loss, cycle=3) and not draft_families.falls([1, 9, 5, 2, 8, 4, 3, 8], cycle=4)


def test_every_supported_pair_is_benched():
    from hsx_client.corpus.drafts import DRAFTS

    pairs = set(draft_families.all_pairs())
    assert ("specforge", "eagle3") in pairs and ("speculators", "eagle3") in pairs and not draft_families.SKIPPED
    assert pairs == {(f, d) for d, x in DRAFTS.items() for f in x.trainers}


@pytest.mark.slow  # importing SpecForge takes seconds
def test_specforges_target_gets_the_index_its_head_loader_reads(tmp_path):
    """SpecForge's TargetHead.load_weights looks the lm_head up in a `*.index.json` weight map."""
    from safetensors import safe_open

    if not draft_families.MODEL.exists():
        pytest.skip("the shared fixture model is not here")
    target = draft_families.specforge_target(draft_families.MODEL, tmp_path)
    (index,) = target.glob("*.index.json")
    weight_map = json.loads(index.read_text())["weight_map"]
    with safe_open(str(target / weight_map["model.embed_tokens.weight"]), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").shape[0] == 512
    assert draft_families.specforge_target(draft_families.MODEL, tmp_path) == target  # a rerun reuses it
    # SpecForge's own loader takes it, and holds the head in bfloat16 whatever the run's dtype
    # (why the bench's SpecForge EAGLE-3 corpus is bfloat16; README "Other drafts")
    target_head = pytest.importorskip("specforge.modeling.target.target_head")
    head = target_head.TargetHead.from_pretrained(str(target), lm_head_key="model.embed_tokens.weight")
    assert head.fc.weight.dtype == torch.bfloat16 and head.fc.weight.shape == (512, 64)
    with pytest.raises(RuntimeError, match="same dtype"):
        head(torch.zeros(1, 3, 64))  # a float32 hidden_state
