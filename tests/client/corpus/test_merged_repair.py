"""Issue 36 item 3: a merged corpus is repaired in place, and a repair never writes through a
hard link into another corpus. Without an engine (the real client, formats, merge and
verify against the in-process fake server of _shard_helpers).

A merged sample file is a hard link to its shard's: corrupting it corrupts both. Then
- `hsx verify MERGED` names the sample, says the shard holds the same damage, and prints
  advice that works: `hsx extract --output MERGED` extracts exactly that sample again
  (it used to refuse: "a merged corpus takes no more samples"), the repaired file replaces
  the link (the shard's file is untouched, still damaged), the merge's record
  (hsx_corpus.json: shards, failed and dropped samples) is kept;
- or the shard is repaired and `hsx merge MERGED SHARD...` brings MERGED up to date (it
  used to refuse: "shards changed"), linking the shard's new file; a shard still damaged
  is named, never linked in."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from hsx_client.corpus import extract as ex
from hsx_client.corpus import journal, store
from hsx_client.corpus.cli import verify_main
from hsx_client.corpus.formats import get_format
from hsx_client.corpus.merge import run_merge
from hsx_client.corpus.merged import REPAIRING_NAME
from hsx_client.corpus.verify import compaction_moves, verify_corpus
from hsx_client.settings import ClientSettings
from _shard_helpers import FakeHsx, extract, write_inputs

POLICY = {"speculators": "per_turn", "specforge": "all_turns"}
# right truncation at 10 tokens leaves some rows nothing to supervise: every shard drops some
SETTINGS = dict(max_samples=24, max_length=10, truncation="right", seed=2)


def sample_file(fmt: str, index: int) -> str:
    f = get_format(fmt)
    return f.hs_path(index) if fmt == "speculators" else f.ckpt_path(index)


def corrupt(path: Path) -> tuple[bytes, bytes]:
    """(the bytes before, after) one byte flipped in place (same size, same inode)."""
    data = path.read_bytes()
    bad = bytearray(data)
    bad[-3] ^= 0xFF
    with open(path, "r+b") as f:  # in place, as bit rot or a stray tool would: both links see it
        f.write(bytes(bad))
    return data, bytes(bad)


class Built:
    def __init__(self, tmp: Path, fmt: str):
        self.fmt = fmt
        self.inputs = write_inputs(tmp / "in.jsonl", 30)
        self.shards = [tmp / f"s{i}" for i in range(2)]
        for i, d in enumerate(self.shards):
            self.extract(d, shard=(i, 2))
        self.out = tmp / "merged"
        r = run_merge(self.out, self.shards)
        assert r.exit_code == 0, r.summary
        self.record = json.loads((self.out / "hsx_corpus.json").read_text())
        assert self.record["counts"]["global_dropped"] > 0, "the settings must drop samples"

    def extract(self, out: Path, shard=None, server=None, expect_ok=True, **kw):
        if expect_ok:
            return extract(out, self.inputs, shard=shard, fmt=self.fmt, mask_policy=POLICY[self.fmt], server=server,
                           **SETTINGS)
        cfg = ex.ExtractConfig(client=ClientSettings.given(["http://fake"], max_attempts=1), output=out,
                               inputs=[str(self.inputs)], format=self.fmt, quiet=True,
                               shard=ex.planning.ShardSpec(*shard) if shard else None, **kw, **SETTINGS)
        return ex.run_extract(cfg, transport=httpx.MockTransport(server or FakeHsx()))

    def shard_file(self, index: int) -> Path:
        """The shard's own file of merged sample `index` (where its finalize moved it)."""
        e = next(e for e in journal.read_jsonl(self.out / "manifest.jsonl")[0] if e["index"] == index and "shard" in e)
        shard = self.shards[e["shard"]]
        at = compaction_moves(shard).get(e["shard_index"], e["shard_index"])
        return shard / sample_file(self.fmt, at)


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_hsx_extract_repairs_a_merged_corpus_in_place_and_leaves_the_shard_alone(tmp_path, fmt, capsys):
    b = Built(tmp_path, fmt)
    k = 5
    victim, shard_file = b.out / sample_file(fmt, k), b.shard_file(k)
    assert os.path.samefile(victim, shard_file)
    original, damaged = corrupt(victim)
    others = {i: os.stat(b.out / sample_file(fmt, i)).st_ino for i in range(b.record["counts"]["done"]) if i != k}

    assert verify_main([str(b.out)]) == 1
    err = capsys.readouterr().err
    assert f"BAD {k} " in err and f"hsx extract --output {b.out}" in err and f"hsx merge {b.out}" in err, err
    shard = next(s for s in b.shards if s in shard_file.parents)
    assert f"hard links into {shard.resolve()}, which holds the same damage" in err, err
    assert "0 failed at extraction in the shards" in err and "(merged from 2 shards)" in err, err

    r = b.extract(b.out)
    assert r.summary["samples_this_run"] == 1 and r.summary["done"] == b.record["counts"]["done"], r.summary
    assert victim.read_bytes() == original
    # copy-on-repair: a new file in the merged corpus, the shard's own untouched (still damaged)
    assert not os.path.samefile(victim, shard_file) and shard_file.read_bytes() == damaged
    assert {i: os.stat(b.out / sample_file(fmt, i)).st_ino for i in others} == others  # the rest stay links
    report = verify_corpus(b.out)
    assert report["ok"], report
    after = json.loads((b.out / "hsx_corpus.json").read_text())
    assert after["merge"] == b.record["merge"] and after["counts"] == b.record["counts"] and after["repairs"]
    assert not (b.out / REPAIRING_NAME).exists()
    assert verify_corpus(shard)["bad"], "the shard keeps its damage (its own repair is its own)"
    assert b.extract(b.out).summary["message"] == "already complete"


def test_a_missing_merged_file_is_extracted_again(tmp_path):
    b = Built(tmp_path, "speculators")
    (b.out / sample_file("speculators", 3)).unlink()
    r = b.extract(b.out)
    assert r.summary["samples_this_run"] == 1, r.summary
    assert verify_corpus(b.out)["ok"] and b.shard_file(3).exists()


def test_a_repair_that_fails_leaves_the_merged_corpus_unfinished_until_a_rerun(tmp_path):
    b = Built(tmp_path, "speculators")
    corrupt(b.out / sample_file("speculators", 2))
    verify_corpus(b.out)
    key = json.loads((b.out / "plan.json").read_text())["keys"][2]
    r = b.extract(b.out, server=FakeHsx(fail_keys={key}), expect_ok=False)
    assert r.exit_code == 1 and "could not be extracted again" in r.summary["message"], r.summary
    assert not (b.out / "hsx_corpus.json").exists() and (b.out / REPAIRING_NAME).exists()
    report = verify_corpus(b.out)
    assert not report["ok"] and report["missing"] == 1 and report["failed"] == b.record["counts"]["global_failed"]
    r = b.extract(b.out)
    assert r.summary["samples_this_run"] == 1 and verify_corpus(b.out)["ok"], r.summary
    assert json.loads((b.out / "hsx_corpus.json").read_text())["merge"] == b.record["merge"]


def test_a_merged_corpus_refuses_shard_and_retry_failed(tmp_path):
    b = Built(tmp_path, "speculators")
    r = b.extract(b.out, shard=(0, 2), expect_ok=False)
    assert r.exit_code == 2 and "merged corpus" in r.summary["message"] and "--shard" in r.summary["message"]
    r = b.extract(b.out, retry_failed=True, expect_ok=False)
    assert r.exit_code == 2 and "--retry-failed --output SHARD" in r.summary["message"], r.summary
    assert verify_corpus(b.out)["ok"]


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_merge_again_after_the_shard_was_repaired(tmp_path, fmt):
    """The issue's path: corrupt, repair the shard, rerun the same `hsx merge`."""
    b = Built(tmp_path, fmt)
    k = 4
    victim, shard_file = b.out / sample_file(fmt, k), b.shard_file(k)
    original, _ = corrupt(victim)
    shard = next(s for s in b.shards if s in shard_file.parents)
    assert verify_corpus(shard)["bad"]
    b.extract(shard, shard=(b.shards.index(shard), 2))  # the shard's repair: a new file, a new inode
    assert shard_file.read_bytes() == original and not os.path.samefile(victim, shard_file)

    r = run_merge(b.out, b.shards)
    assert r.exit_code == 0 and r.summary["refreshed"] == 1 and r.summary["linked"] == 1, r.summary
    assert os.path.samefile(victim, shard_file) and victim.read_bytes() == original
    assert verify_corpus(b.out)["ok"]
    after = json.loads((b.out / "hsx_corpus.json").read_text())
    assert after["counts"] == b.record["counts"]
    # the record names the repaired shard as it is now (its manifest grew by the repair's lines)
    assert [s["manifest_bytes"] for s in after["merge"]["shards"]] != \
        [s["manifest_bytes"] for s in b.record["merge"]["shards"]]
    assert run_merge(b.out, b.shards).summary["message"] == "already complete"


def test_merge_again_names_a_shard_still_damaged_and_links_nothing_from_it(tmp_path):
    """A merged sample repaired in place, its shard still damaged; another shard changes:
    the merged sample is intact and kept. Then both are damaged and the merge refuses to link."""
    b = Built(tmp_path, "speculators")
    k = 1
    victim, shard_file = b.out / sample_file("speculators", k), b.shard_file(k)
    original, damaged = corrupt(victim)
    verify_corpus(b.out)
    b.extract(b.out)  # repaired in place: the merged file is whole, the shard's not
    touched = b.shards[1] if b.shards[0] in shard_file.parents else b.shards[0]
    p = touched / "hsx_corpus.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "created_at": "later"}))  # a changed shard record
    r = run_merge(b.out, b.shards)
    assert r.exit_code == 0 and r.summary["refreshed"] == 0, r.summary
    assert victim.read_bytes() == original and shard_file.read_bytes() == damaged

    corrupt(victim)  # now the merged file is damaged too: placing it again needs the shard's, which is damaged
    p.write_text(json.dumps({**json.loads(p.read_text()), "created_at": "later still"}))
    r = run_merge(b.out, b.shards)
    assert r.exit_code == 1 and "damaged too" in r.summary["message"] and str(shard_file.parents[1]) in r.summary["message"]
    assert not os.path.exists(victim) or not os.path.samefile(victim, shard_file)


def test_merge_of_other_samples_is_still_refused(tmp_path):
    b = Built(tmp_path, "speculators")
    other = [tmp_path / f"o{i}" for i in range(2)]
    for i, d in enumerate(other):
        extract(d, b.inputs, shard=(i, 2), fmt="speculators", mask_policy="per_turn", **{**SETTINGS, "seed": 9})
    r = run_merge(b.out, other)
    assert r.exit_code == 2 and "holds a merge of other shards" in r.summary["problems"][0]
    assert verify_corpus(b.out)["ok"]


# ----------------------------------------------------------------------------- item 5: verify's summary
def test_verify_of_a_merged_corpus_counts_what_its_record_counts(tmp_path, capsys):
    """`hsx verify MERGED` printed "0 failed at extraction, 0 dropped" while hsx_corpus.json
    counted the shards' failed and dropped samples: it reads them from the merge's record."""
    inputs = write_inputs(tmp_path / "in.jsonl", 30)
    shards = [tmp_path / f"s{i}" for i in range(2)]
    extract(shards[0], inputs, shard=(0, 2), fmt="speculators", **SETTINGS)
    extract(shards[1], inputs, shard=(1, 2), fmt="speculators", **SETTINGS)
    keys1 = json.loads((shards[1] / "plan.json").read_text())["keys"]
    shutil.rmtree(shards[1])  # shard 1 again, two of its samples failing for good
    extract(shards[1], inputs, shard=(1, 2), fmt="speculators", server=FakeHsx(fail_keys=set(keys1[:2])), **SETTINGS)
    out = tmp_path / "merged"
    assert run_merge(out, shards).exit_code == 0
    counts = json.loads((out / "hsx_corpus.json").read_text())["counts"]
    assert counts["global_failed"] == 2 and counts["global_dropped"] > 0, counts

    assert verify_main([str(out), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert (report["failed"], report["dropped"]) == (counts["global_failed"], counts["global_dropped"])
    last = captured.err.strip().splitlines()[-1]
    assert last == (f"verify OK: {counts['done']}/{counts['global_planned']} samples stored (merged from 2 shards), "
                    f"{counts['global_failed']} failed at extraction in the shards, {counts['global_dropped']} dropped "
                    "(no supervised token) in the shards, 0 missing, 0 bad"), last
    assert counts["done"] + counts["global_failed"] + counts["global_dropped"] == counts["global_planned"]
