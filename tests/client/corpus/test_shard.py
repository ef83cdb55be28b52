"""Issue 14, shards: where I/N come from (flags, Kubernetes, Slurm), the slices of the global
plan, and `hsx extract --shard` writing shard corpora that cover one plan exactly once."""

from __future__ import annotations

import json

import httpx
import pytest

from hsx_client.corpus import extract as ex
from hsx_client.corpus.cli import extract_main
from hsx_client.corpus.plan import ShardError, ShardSpec, shard_bounds
from hsx_client.corpus.shard import resolve
from hsx_client.settings import ClientSettings
from _shard_helpers import FakeHsx, extract, write_inputs


# ----------------------------------------------------------------------------- where I/N come from
@pytest.mark.parametrize("flag, num, env, want", [
    ("2/5", None, {}, (2, 5)),
    ("2", 5, {}, (2, 5)),
    ("2", None, {"HSX_NUM_SHARDS": "5"}, (2, 5)),
    ("0/1", None, {"JOB_COMPLETION_INDEX": "3"}, (0, 1)),  # the flag wins over the scheduler
    (None, None, {"JOB_COMPLETION_INDEX": "3", "HSX_NUM_SHARDS": "8"}, (3, 8)),
    (None, 8, {"JOB_COMPLETION_INDEX": "7"}, (7, 8)),
    (None, None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "6"}, (4, 6)),
    (None, None, {"SLURM_ARRAY_TASK_ID": "14", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "6"}, (4, 6)),
    (None, None, {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "3",
                  "SLURM_ARRAY_TASK_COUNT": "3"}, (2, 3)),
    (None, None, {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "6", "HSX_NUM_SHARDS": "2"}, (1, 2)),
    (None, None, {}, None),
])
def test_shard_comes_from_flags_or_the_scheduler(flag, num, env, want):
    got = resolve(flag, num, env)
    assert (got.index, got.count) == want if want else got is None


@pytest.mark.parametrize("flag, num, env, words", [
    ("5/5", None, {}, "outside 0..4"),
    ("1/0", None, {}, "at least 1"),
    ("a/4", None, {}, "integer"),
    ("2", None, {}, "give the count"),
    ("1/4", 3, {}, "says 3"),
    (None, None, {"JOB_COMPLETION_INDEX": "3"}, "HSX_NUM_SHARDS"),
    (None, None, {"SLURM_ARRAY_TASK_ID": "3"}, "no shard count"),
    (None, None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_STEP": "3", "SLURM_ARRAY_TASK_COUNT": "3"}, "grid"),
    (None, None, {"JOB_COMPLETION_INDEX": "9", "HSX_NUM_SHARDS": "4"}, "outside 0..3"),
])
def test_bad_shard_settings_are_refused_with_the_reason(flag, num, env, words):
    with pytest.raises(ShardError, match=words):
        resolve(flag, num, env)


def test_cli_refuses_a_bad_shard_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    monkeypatch.delenv("HSX_NUM_SHARDS", raising=False)
    rc = extract_main(["--server", "http://x", "--output", str(tmp_path / "o"), "--input", "x.jsonl"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "JOB_COMPLETION_INDEX=1" in err


@pytest.mark.parametrize("n, count", [(10, 3), (7, 7), (1000, 16), (5, 1)])
def test_slices_cover_the_plan_once_and_differ_by_at_most_one(n, count):
    slices = [shard_bounds(ShardSpec(i, count), n) for i in range(count)]
    assert slices[0][0] == 0 and slices[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    sizes = [b - a for a, b in slices]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


# ----------------------------------------------------------------------------- shard corpora
def test_shards_hold_the_global_plan_exactly_once(tmp_path):
    inputs = write_inputs(tmp_path / "in.jsonl", 23)
    extract(tmp_path / "single", inputs, seed=3, max_samples=20)
    single = json.loads((tmp_path / "single" / "plan.json").read_text())
    assert "shard" not in single
    plans = []
    for i in range(3):
        extract(tmp_path / f"s{i}", inputs, shard=(i, 3), seed=3, max_samples=20)
        plans.append(json.loads((tmp_path / f"s{i}" / "plan.json").read_text()))
    assert [k for p in plans for k in p["keys"]] == single["keys"]  # the same global order, cut in three
    secs = [p["shard"] for p in plans]
    assert [(s["index"], s["count"], s["start"], s["stop"]) for s in secs] == [(0, 3, 0, 6), (1, 3, 6, 13), (2, 3, 13, 20)]
    assert len({s["global_fingerprint"] for s in secs}) == 1 and all(s["global_samples"] == 20 for s in secs)
    corpus = json.loads((tmp_path / "s1" / "hsx_corpus.json").read_text())
    assert corpus["shard"] == secs[1] and corpus["counts"]["done"] == 7
    # another seed is another global plan
    extract(tmp_path / "other", inputs, shard=(0, 3), seed=4, max_samples=20)
    other = json.loads((tmp_path / "other" / "plan.json").read_text())["shard"]
    assert other["global_fingerprint"] != secs[0]["global_fingerprint"]


def test_resume_keeps_the_shard_and_refuses_another(tmp_path):
    inputs = write_inputs(tmp_path / "in.jsonl", 9)
    out = tmp_path / "s1"
    extract(out, inputs, shard=(1, 3))
    again = extract(out, inputs)  # no --shard: the plan's shard is kept
    assert again.summary["done"] == 3
    for shard in ((2, 3), (1, 4)):
        r = ex.run_extract(ex.ExtractConfig(client=ClientSettings.given(["http://f"]), output=out, inputs=[str(inputs)], quiet=True,
                                            shard=ShardSpec(*shard)),
                           transport=httpx.MockTransport(FakeHsx()))
        assert r.exit_code == 2 and "the plan is shard 1/3" in r.summary["message"]


def test_more_shards_than_samples_is_refused(tmp_path):
    inputs = write_inputs(tmp_path / "in.jsonl", 3)
    r = ex.run_extract(ex.ExtractConfig(client=ClientSettings.given(["http://f"]), output=tmp_path / "o", inputs=[str(inputs)],
                                        format="speculators", quiet=True, shard=ShardSpec(0, 4)),
                       transport=httpx.MockTransport(FakeHsx()))
    assert r.exit_code == 2 and "fewer than 4 shards" in r.summary["message"]
