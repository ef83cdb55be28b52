"""bench/draft_families.py's short version (issue 39): one draft beyond EAGLE-3 per trainer,
trained from an hsx corpus of the fixture model's states by the trainer's own model and
loss on the CPU; the loss falls. The full run's record: bench/results-cpu-*-draft-families.json."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import draft_families  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("trainer,draft", [("speculators", "dspark"), ("specforge", "dflash")])
def test_a_non_eagle_draft_trains_from_an_hsx_corpus(tmp_path, trainer, draft):
    pytest.importorskip(trainer)
    if not draft_families.MODEL.exists():
        pytest.skip("the shared fixture model is not here")
    (run,) = draft_families.run([(trainer, draft)], steps=12, samples=16, work=tmp_path)
    assert run["layers"] and len(run["loss"]) == 12
    assert run["falls"], run["loss"]


def test_every_supported_pair_is_benched_but_specforges_eagle3():
    from hsx_client.corpus.drafts import DRAFTS

    pairs = set(draft_families.all_pairs())
    assert ("specforge", "eagle3") not in pairs and ("speculators", "eagle3") in pairs
    assert pairs | draft_families.SKIPPED == {(f, d) for d, x in DRAFTS.items() for f in x.trainers}
