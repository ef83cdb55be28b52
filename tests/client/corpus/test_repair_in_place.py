"""Issue 25 item 2: a corpus whose finalize renumbered its samples (speculators compacts
dropped and failed samples away, hsx_compaction.json) is repaired in place like any other:
`hsx verify` names the corrupted sample, the next `hsx extract` redoes exactly that one
(under its plan index, then finalize moves it to its place again) and the corpus verifies,
the repaired file byte for byte the original. Without an engine (the real client and
formats against the in-process fake server); the same on a real engine and the OASST
fixture is tests/e2e/test_repair_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsx_client.corpus import store
from hsx_client.corpus.formats import get_format
from hsx_client.corpus.verify import compaction_moves, verify_corpus
from hsx_client.settings import ClientSettings
from _shard_helpers import FakeHsx, extract, write_inputs

# right truncation at 10 tokens leaves some rows with no supervised token: they are dropped
SETTINGS = dict(max_samples=20, max_length=10, truncation="right", seed=1)
POLICY = {"speculators": "per_turn", "specforge": "all_turns"}


def sample_path(fmt_name: str, index: int) -> str:
    fmt = get_format(fmt_name)
    return fmt.hs_path(index) if fmt_name == "speculators" else fmt.ckpt_path(index)


def corrupt(path: Path) -> bytes:
    """Flip one byte near the end (same size: only the checksum or the reader can tell)."""
    data = path.read_bytes()
    bad = bytearray(data)
    bad[-3] ^= 0xFF
    path.write_bytes(bytes(bad))
    return data


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_a_corrupted_sample_of_a_corpus_with_drops_is_repaired_in_place(tmp_path, fmt):
    inputs = write_inputs(tmp_path / "in.jsonl", 30)
    out = tmp_path / "corpus"
    server = FakeHsx()
    extract(out, inputs, fmt=fmt, mask_policy=POLICY[fmt], server=server, **SETTINGS)
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert corpus["dropped_indices"], "the settings must drop samples"
    moves = compaction_moves(out)
    assert bool(moves) == (fmt == "speculators"), moves
    # a sample finalize moved (speculators), else any stored one
    old, new = next(iter(moves.items())) if moves else (min(set(range(20)) - set(corpus["dropped_indices"])),) * 2
    victim = out / sample_path(fmt, new)
    original = corrupt(victim)
    table_before = sorted(p.name for p in out.glob("*.arrow"))

    report = verify_corpus(out)
    assert not report["ok"] and [b["index"] for b in report["bad"]] == [old], report
    assert sample_path(fmt, new) in " ".join(report["bad"][0]["problems"])
    assert (out / store.VERIFY_NAME).exists()

    r = extract(out, inputs, fmt=fmt, mask_policy=POLICY[fmt], server=server, **SETTINGS)
    assert r.summary["samples_this_run"] == 1 and r.summary["done"] == corpus["counts"]["done"], r.summary
    assert victim.read_bytes() == original
    assert not (out / sample_path(fmt, old)).exists() or old == new  # moved back into its place
    assert compaction_moves(out) == moves
    report = verify_corpus(out)
    assert report["ok"], report
    assert sorted(p.name for p in out.glob("*.arrow")) == table_before
    assert json.loads((out / "hsx_corpus.json").read_text())["dropped_indices"] == corpus["dropped_indices"]
    # a rerun now has nothing to do
    again = extract(out, inputs, fmt=fmt, mask_policy=POLICY[fmt], server=server, **SETTINGS)
    assert again.summary["message"] == "already complete"


def test_retry_failed_is_still_refused_after_renumbering(tmp_path):
    inputs = write_inputs(tmp_path / "in.jsonl", 30)
    out = tmp_path / "corpus"
    extract(out, inputs, **SETTINGS)
    assert compaction_moves(out)
    import httpx

    from hsx_client.corpus import extract as ex

    cfg = ex.ExtractConfig(client=ClientSettings.given(["http://fake"]), output=out, inputs=[str(inputs)], format="speculators",
                           quiet=True, retry_failed=True, **SETTINGS)
    r = ex.run_extract(cfg, transport=httpx.MockTransport(FakeHsx()))
    assert r.exit_code == 2 and "--retry-failed would add samples" in r.summary["message"], r.summary


def test_a_repair_stopped_before_finalize_is_finished_by_the_next_run(tmp_path, monkeypatch):
    """`--verify` finds the corrupted sample itself; the redone sample is stored under its
    plan index, then the run stops before finalize (as a crash would): `hsx verify` checks
    it where it is and calls nothing bad, and the next run moves it into place."""
    import httpx

    from hsx_client.corpus import extract as ex

    inputs = write_inputs(tmp_path / "in.jsonl", 30)
    out = tmp_path / "corpus"
    extract(out, inputs, **SETTINGS)
    old, new = next(iter(compaction_moves(out).items()))
    victim = out / sample_path("speculators", new)
    original = corrupt(victim)

    def crash(*a, **kw):
        raise OSError(5, "simulated crash before finalize")

    cfg = ex.ExtractConfig(client=ClientSettings.given(["http://fake"]), output=out, inputs=[str(inputs)], format="speculators",
                           quiet=True, verify=True, **SETTINGS)
    with monkeypatch.context() as m:
        m.setattr(ex, "finalize", crash)
        r = ex.run_extract(cfg, transport=httpx.MockTransport(FakeHsx()))
    assert r.exit_code == 1 and "simulated crash" in r.summary["message"], r.summary
    assert (out / sample_path("speculators", old)).exists() and not (out / "hsx_corpus.json").exists()
    report = verify_corpus(out)
    assert not report["bad"] and any("not finalized" in p for p in report["problems"]), report
    r = ex.run_extract(cfg, transport=httpx.MockTransport(FakeHsx()))
    assert r.exit_code == 0, r.summary
    assert victim.read_bytes() == original and not (out / sample_path("speculators", old)).exists()
    assert verify_corpus(out)["ok"]
