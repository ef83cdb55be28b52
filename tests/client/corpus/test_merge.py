"""Issue 14, `hsx merge`: shards of one run -> one corpus, equal to a single client's, without
an engine (the real client, formats and reader against an in-process fake server; the
engine end to end with the trainers' readers is tests/e2e/test_shard_e2e.py).

- merged == single-client corpus (same keys in the same order, same ids, masks and states,
  same token_freq / d2t / t2d / vocab_mapping), `hsx verify` passes, shards stay intact and
  the states are hard-linked, not copied;
- across filesystems the files are copied and checked against the shards' checksums;
- SIGKILL of `hsx merge` at every step, then a rerun: the same corpus;
- every disagreement between shards, and every unusable shard or output, is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from hsx_client.corpus import journal, store
from hsx_client.corpus.verify import compaction_moves, verify_corpus
from hsx_client.corpus.formats import get_format
from hsx_client.corpus.cli import merge_main
from hsx_client.corpus.merge import run_merge
from _shard_helpers import FakeHsx, extract, merge_cli, write_inputs

FORMATS = {"speculators": "per_turn", "specforge": "all_turns"}


# ----------------------------------------------------------------------------- reading a corpus
def samples_by_key(out: Path) -> dict[str, dict]:
    """{key: input_ids, loss_mask and every state tensor} of a finished corpus, by key."""
    plan = json.loads((out / "plan.json").read_text())
    fmt_name = plan["settings"]["format"]
    entries, _, _ = journal.read_jsonl(out / "manifest.jsonl")
    done = journal.latest_by_index(entries)
    moves = compaction_moves(out)
    res = {}
    if fmt_name == "speculators":
        import datasets
        from safetensors.torch import load_file

        table = datasets.load_from_disk(str(out))
        for i, e in done.items():
            p = moves.get(i, i)
            row = table[p]
            st = load_file(str(out / f"hidden_states/hs_{p}.safetensors"))
            res[e["key"]] = {"input_ids": list(row["input_ids"]), "loss_mask": list(row["loss_mask"]), **st}
    else:
        fmt = get_format("specforge")
        for i, e in done.items():
            raw = torch.load(out / fmt.ckpt_path(moves.get(i, i)), weights_only=True)
            res[e["key"]] = {k: (v.tolist() if k in ("input_ids", "loss_mask") else v) for k, v in raw.items()}
    return res


def assert_same_samples(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].keys() == b[k].keys()
        for name, v in a[k].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b[k][name]), (k, name)
            else:
                assert v == b[k][name], (k, name)


def vocab_files(out: Path) -> dict[str, bytes]:
    names = ["token_freq.pt", "vocab_mapping/vocab_mapping.pt", "hsx_format.json", *[p.name for p in out.glob("[dt]2[dt]-*.npy")]]
    return {n: (out / n).read_bytes() for n in names if (out / n).exists()}


def assert_files_say_only_true_things(out: Path) -> None:
    """Issue 25 item 3: a sample file's own metadata holds nothing that its position in
    this corpus contradicts (a hard-linked file is at another index in each corpus)."""
    from safetensors import safe_open

    files = sorted(out.glob("hidden_states/hs_*.safetensors")) + sorted(out.glob("token_ids/ids_*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            meta = st.metadata() or {}
        position = f.stem.rpartition("_")[2]
        assert meta.get("index", position) == position, (f, meta)
        assert set(meta) <= {"format", "layer_ids", "index"}, (f, meta)  # nothing else shard-local


def make_shards(tmp: Path, inputs: Path, count: int, fmt: str = "speculators", name: str = "s", **kw) -> list[Path]:
    dirs = []
    for i in range(count):
        d = tmp / f"{name}{i}"
        extract(d, inputs, shard=(i, count), fmt=fmt, mask_policy=FORMATS[fmt], **kw)
        dirs.append(d)
    return dirs


@pytest.fixture
def inputs(tmp_path) -> Path:
    return write_inputs(tmp_path / "in.jsonl", 23)


# ----------------------------------------------------------------------------- the merged corpus
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_merge_equals_a_single_client_run(tmp_path, inputs, fmt, capsys):
    settings = dict(seed=5, max_samples=20, draft_vocab_size=8)
    single = tmp_path / "single"
    extract(single, inputs, fmt=fmt, mask_policy=FORMATS[fmt], **settings)
    shards = make_shards(tmp_path, inputs, 3, fmt, **settings)
    out = tmp_path / "merged"
    rc = merge_main([str(out), *map(str, reversed(shards)), "--json", "--quiet"])  # any order will do
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "hsx merge: 3 shards -> 20 samples" in captured.err
    summary = json.loads(captured.out)
    assert summary["samples"] == 20 and summary["shards"] == 3 and summary["linked"] == 20 and summary["copied"] == 0

    # the same plan order, samples, vocab mapping and format facts as one client's corpus
    keys = json.loads((out / "plan.json").read_text())["keys"]
    assert keys == json.loads((single / "plan.json").read_text())["keys"]
    assert_same_samples(samples_by_key(out), samples_by_key(single))
    assert vocab_files(out) == vocab_files(single) and len(vocab_files(out)) >= 2
    report = verify_corpus(out)
    assert report["ok"] and report["done"] == 20, report

    corpus = json.loads((out / "hsx_corpus.json").read_text())
    ref = json.loads((single / "hsx_corpus.json").read_text())
    for k in ("model", "model_revision", "layer_ids", "chat_template_sha256", "format", "mask_policy", "max_length"):
        assert corpus[k] == ref[k], k
    assert corpus["counts"]["done"] == 20 and corpus["counts"]["tokens"] == ref["counts"]["tokens"]
    listed = corpus["merge"]["shards"]
    assert [s["index"] for s in listed] == [0, 1, 2] and [s["path"] for s in listed] == [str(p.resolve()) for p in shards]
    assert sum(s["done"] for s in listed) == 20 and corpus["merge"]["num_shards"] == 3

    # no copy of the states: every sample file is the shard's own inode; the shards stay whole
    entries, _, _ = journal.read_jsonl(out / "manifest.jsonl")
    shard_files = [{e["index"]: e["files"] for e in journal.read_jsonl(s / "manifest.jsonl")[0]} for s in shards]
    for e in entries:
        (rel,) = e["files"]
        (src,) = shard_files[e["shard"]][e["shard_index"]]
        assert os.path.samefile(out / rel, shards[e["shard"]] / src)
    for s in shards:
        assert verify_corpus(s)["ok"]
    # a rerun of the finished merge changes nothing
    again = run_merge(out, shards)
    assert again.exit_code == 0 and again.summary["message"] == "already complete"


@pytest.mark.parametrize("variant", [{"dtype": "fp8"}, {"states": "none"}])
def test_fp8_and_token_table_shards_merge_as_their_variant(tmp_path, inputs, variant):
    """`--dtype fp8` / `--states none` shards: the merge uses the format's own variant (its
    per-sample files, its finalize), and the result holds one client's corpus: the same
    tensors in every sample file (hard links: the same bytes, no index inside), the
    same table and vocab files."""
    from safetensors.torch import load_file

    settings = dict(seed=5, max_samples=12, draft_vocab_size=8, **variant)
    single = tmp_path / "single"
    extract(single, inputs, **settings)
    out = tmp_path / "merged"
    r = run_merge(out, make_shards(tmp_path, inputs, 2, **settings))
    assert r.exit_code == 0, r.summary
    fmt = get_format("speculators", **variant)
    assert fmt.hs_path(0) != get_format("speculators").hs_path(0) or "dtype" in variant
    for i in range(12):
        got, want = load_file(out / fmt.hs_path(i)), load_file(single / fmt.hs_path(i))
        assert got.keys() == want.keys() and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                                 for k in want), i
    assert vocab_files(out) == vocab_files(single)
    import datasets

    assert datasets.load_from_disk(str(out)).with_format(None)[:] == datasets.load_from_disk(str(single)).with_format(None)[:]
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert (corpus["states"], corpus["states_dtype"]) == (variant.get("states", "all"), variant.get("dtype", "auto"))
    assert verify_corpus(out)["ok"]
    assert_files_say_only_true_things(out)


def test_failed_samples_are_left_out_and_listed(tmp_path, inputs):
    """A shard whose finalize compacted failed samples away: the merge reads each sample
    where finalize moved it, and lists the failed keys."""
    shards = make_shards(tmp_path, inputs, 2, max_samples=12)
    plan_keys = json.loads((shards[0] / "plan.json").read_text())["keys"]
    shutil.rmtree(shards[0])  # shard 0 again, with its first two samples failing for good
    extract(shards[0], inputs, shard=(0, 2), max_samples=12, server=FakeHsx(fail_keys=set(plan_keys[:2])))
    assert compaction_moves(shards[0]), "expected finalize to renumber"
    out = tmp_path / "merged"
    r = run_merge(out, shards)
    assert r.exit_code == 0, r.summary
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert corpus["counts"]["done"] == 10 and corpus["counts"]["global_failed"] == 2
    assert corpus["merge"]["shards"][0]["failed_keys"] == plan_keys[:2]
    merged = samples_by_key(out)
    assert sorted(merged) == sorted(set(plan_keys[2:]) | set(json.loads((shards[1] / "plan.json").read_text())["keys"]))
    whole = {**samples_by_key(shards[0]), **samples_by_key(shards[1])}
    assert_same_samples(merged, whole)
    assert verify_corpus(out)["ok"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_shards_that_dropped_samples_merge_like_one_client(tmp_path, inputs, fmt):
    """Issue 25 item 1: every shard drops samples (no supervised token left after right
    truncation), each at its own indices; the shards' dropped_indices are combined, not
    compared, and the merge is the single client's corpus, drops listed by global index."""
    settings = dict(seed=5, max_samples=20, max_length=10, truncation="right")
    single = tmp_path / "single"
    extract(single, inputs, fmt=fmt, mask_policy=FORMATS[fmt], **settings)
    ref = json.loads((single / "hsx_corpus.json").read_text())
    shards = make_shards(tmp_path, inputs, 3, fmt, **settings)
    per_shard = [json.loads((s / "hsx_corpus.json").read_text())["dropped_indices"] for s in shards]
    assert all(per_shard) and len({tuple(d) for d in per_shard}) == 3, per_shard  # each drops, each its own
    out = tmp_path / "merged"
    r = run_merge(out, shards)
    assert r.exit_code == 0, r.summary
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    assert corpus["merge"]["global_dropped_indices"] == ref["dropped_indices"]
    assert corpus["counts"]["global_dropped"] == ref["counts"]["dropped"] and corpus["counts"]["global_failed"] == 0
    assert corpus["counts"]["done"] == ref["counts"]["done"] == 20 - len(ref["dropped_indices"])
    assert corpus["counts"]["truncated"] == ref["counts"]["truncated"]  # (the fake server does not say)
    plan_keys = json.loads((single / "plan.json").read_text())["keys"]
    assert [k for s in corpus["merge"]["shards"] for k in s["dropped_keys"]] == \
        [plan_keys[i] for i in ref["dropped_indices"]]
    assert_same_samples(samples_by_key(out), samples_by_key(single))
    got, want = vocab_files(out), vocab_files(single)
    renumbering = ("compacted_moves", "compaction_journal")  # the single corpus compacted its drops away
    assert {k: v for k, v in json.loads(got.pop("hsx_format.json")).items() if k not in renumbering} == \
        {k: v for k, v in json.loads(want.pop("hsx_format.json")).items() if k not in renumbering}
    assert got == want
    assert verify_corpus(out)["ok"]
    for corpus_dir in (out, single, *shards):
        assert_files_say_only_true_things(corpus_dir)


def test_copies_across_filesystems_with_checksums(tmp_path, inputs):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp dir")
    base = Path(shm / f"hsx-merge-test-{os.getpid()}")
    base.mkdir()
    try:
        shards = make_shards(base, inputs, 2, max_samples=10)
        out = tmp_path / "merged"
        r = run_merge(out, shards)
        assert r.exit_code == 0 and r.summary["copied"] == 10 and r.summary["linked"] == 0, r.summary
        assert verify_corpus(out)["ok"]
        assert_same_samples(samples_by_key(out), {**samples_by_key(shards[0]), **samples_by_key(shards[1])})

        # a shard file corrupted (same size): the copy's checksum catches it, nothing is left half-written
        victim = shards[1] / "hidden_states" / "hs_2.safetensors"
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
        out2 = tmp_path / "merged2"
        r = run_merge(out2, shards)
        assert r.exit_code == 1 and "corrupted" in r.summary["message"] and str(victim) in r.summary["message"]
        assert not list(out2.rglob(f"*{store.TMP_MARK}*"))
    finally:
        shutil.rmtree(base)


# ----------------------------------------------------------------------------- crash safety
@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sigkill_at_every_step_then_rerun_gives_the_same_corpus(tmp_path, fmt):
    """150 samples over 3 shards (3 batches): SIGKILL after the plan, mid-placement of the
    first and of a later batch, after a committed batch, and before hsx_corpus.json; each
    rerun ends with the corpus of an uninterrupted merge."""
    inputs = write_inputs(tmp_path / "in.jsonl", 150)
    shards = make_shards(tmp_path, inputs, 3, fmt, draft_vocab_size=8)
    ref = tmp_path / "ref"
    assert run_merge(ref, shards).exit_code == 0
    want = samples_by_key(ref)
    want_index = {e["index"]: e["key"] for e in journal.read_jsonl(ref / "manifest.jsonl")[0]}
    # kill point -> samples recorded in the manifest by then (batches of 64)
    for point, recorded in (("plan", 0), ("place:10", 0), ("manifest:64", 64), ("place:100", 64), ("finalize", 150)):
        out = tmp_path / f"out-{point.replace(':', '-')}"
        killed = merge_cli(out, shards, env={"HSX_FAULT_MERGE": point})
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        assert (out / "plan.json").exists() and not (out / "hsx_corpus.json").exists()
        assert len(journal.read_jsonl(out / "manifest.jsonl")[0]) == recorded, point
        rerun = merge_cli(out, shards, "--json")
        assert rerun.returncode == 0, (point, rerun.stderr)
        entries, _, torn = journal.read_jsonl(out / "manifest.jsonl")
        assert torn == 0 and sorted(e["index"] for e in entries) == list(range(150)), point  # each sample once
        assert {e["index"]: e["key"] for e in entries} == want_index
        assert_same_samples(samples_by_key(out), want)
        assert vocab_files(out) == vocab_files(ref)
        assert verify_corpus(out)["ok"], point
        assert not list(out.rglob(f"*{store.TMP_MARK}*"))


# ----------------------------------------------------------------------------- refusals
@pytest.fixture
def pair(tmp_path, inputs) -> list[Path]:
    return make_shards(tmp_path, inputs, 2, max_samples=8)


def other_shard1(tmp_path, inputs, **kw) -> Path:
    """Shard 1 of a run that differs from `pair`'s by `kw` (server facts or settings)."""
    server = FakeHsx(**kw.pop("info", {}))
    fmt = kw.pop("fmt", "speculators")
    count = kw.pop("count", 2)
    d = tmp_path / "other1"
    extract(d, inputs, shard=(1, count), server=server, fmt=fmt, mask_policy=FORMATS[fmt],
            **{"max_samples": 8, **kw})
    return d


def refused(out: Path, shards: list[Path]) -> list[str]:
    r = run_merge(out, shards)
    assert r.exit_code == 2 and r.status == "refused", r.summary
    assert not (out / "plan.json").exists() or out.name == "keep", "a refused merge must not start"
    return r.summary["problems"]


def one_line_with(problems: list[str], words: str) -> None:
    assert any(words in p for p in problems), problems
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize("what, change, words", [
    ("model", {"info": {"model": "fake/other"}}, "on model (hsx_corpus.json)"),
    ("revision", {"info": {"model_revision": "r2"}}, "on model_revision"),
    ("layers", {"info": {"layer_ids": [1, 2, 3, 5], "num_hidden_layers": 5}}, "on layer_ids"),
    ("template", {"info": {"chat_template_sha256": "u" * 64}}, "on chat_template_sha256"),
    ("max length", {"max_length": 20}, "on max_length"),
    ("format", {"fmt": "specforge"}, "on format"),
    ("global plan", {"seed": 9}, "different global plans"),
    ("shard count", {"count": 3}, "runs of different sizes"),
    ("fp8", {"dtype": "fp8"}, "on states_dtype (hsx_corpus.json)"),
    ("token table", {"states": "none"}, "on states (hsx_corpus.json)"),
])
def test_shards_that_disagree_are_refused(tmp_path, inputs, pair, what, change, words):
    problems = refused(tmp_path / "out", [pair[0], other_shard1(tmp_path, inputs, **change)])
    one_line_with(problems, words)


def test_a_corpus_of_another_kind_is_refused(tmp_path, pair):
    """Fields a newer writer adds (e.g. a states-none or fp8 corpus) are compared too."""
    p = pair[1] / "hsx_corpus.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "states": "none"}))
    one_line_with(refused(tmp_path / "out", pair), "on states (hsx_corpus.json)")


def test_unfinished_or_flagged_shards_are_refused(tmp_path, inputs, pair):
    (pair[1] / "hsx_corpus.json").unlink()
    one_line_with(refused(tmp_path / "out", pair), "shard 1/2")
    one_line_with(refused(tmp_path / "out", pair), "is not finalized")
    extract(pair[1], inputs)  # finish it again
    lines = (pair[1] / "manifest.jsonl").read_bytes().splitlines(keepends=True)
    (pair[1] / "manifest.jsonl").write_bytes(b"".join(lines[:-1]))
    one_line_with(refused(tmp_path / "out", pair), "is incomplete")
    (pair[1] / "manifest.jsonl").write_bytes(b"".join(lines))
    (pair[1] / "verify.json").write_text("{}")
    one_line_with(refused(tmp_path / "out", pair), "found bad")


def test_missing_duplicate_and_foreign_shards_are_refused(tmp_path, inputs, pair):
    one_line_with(refused(tmp_path / "out", pair[:1]), "shard(s) 1 of 2 are missing")
    twin = tmp_path / "twin"
    shutil.copytree(pair[1], twin)
    one_line_with(refused(tmp_path / "out", [*pair, twin]), "shard 1/2 is given twice")
    one_line_with(refused(tmp_path / "out", [*pair, pair[1]]), "is given twice")
    whole = tmp_path / "whole"
    extract(whole, inputs, max_samples=8)
    one_line_with(refused(tmp_path / "out", [pair[0], whole]), "without --shard")
    one_line_with(refused(tmp_path / "out", [pair[0], tmp_path / "nope"]), "no such directory")
    merged = tmp_path / "merged"
    assert run_merge(merged, pair).exit_code == 0
    one_line_with(refused(tmp_path / "out", [merged]), "is a merged corpus")


def test_edited_plans_are_refused(tmp_path, pair):
    p = pair[1] / "plan.json"
    plan = json.loads(p.read_text())
    plan["shard"]["start"] += 1
    p.write_text(json.dumps(plan))
    one_line_with(refused(tmp_path / "out", pair), "not its slice")


def test_unusable_outputs_are_refused(tmp_path, inputs, pair):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    one_line_with(refused(keep, pair), "is not empty")
    one_line_with(refused(pair[0] / "inside", pair), "lies in the shard")
    one_line_with(refused(tmp_path, pair), "lies inside the output")
    out = tmp_path / "merged"
    assert run_merge(out, pair).exit_code == 0
    others = make_shards(tmp_path, inputs, 2, name="t", max_samples=8, seed=11)
    r = run_merge(out, others)
    assert r.exit_code == 2 and "holds a merge of other shards" in r.summary["problems"][0]
    assert verify_corpus(out)["ok"], "a refused merge must leave the corpus as it was"


def test_cli_refusal_is_one_line_per_problem_and_exit_2(tmp_path, pair, capsys):
    assert merge_main([str(tmp_path / "out"), str(pair[0])]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["hsx merge: shard(s) 1 of 2 are missing (given: 0)"]


# ----------------------------------------------------------------------------- real data, real engine
OASST_MAX_LENGTH = 500  # right truncation at 500 tokens leaves about a quarter of the OASST rows nothing to train on


@pytest.mark.engine
@pytest.mark.fixtures
@pytest.mark.slow
def test_real_shards_that_drop_samples_merge(e2e_pool, tmp_path):
    """Issue 25 item 1 as found: `hsx extract --max-length 500 --shard I/3` over the OASST
    fixture (default right truncation), each shard dropping its own samples, then
    `hsx merge mrg sh0 sh1 sh2`: merged (was refused on dropped_indices), verified, and
    speculators' reader takes every row."""
    pytest.importorskip("speculators", reason="speculators is not installed (the trainer's reader)")
    from _e2e_helpers import HSX, assert_verify_ok, check_speculators_corpus, cli_env, run_extract
    from _server import CHAT
    from hsx_client.corpus.inputs import read_samples

    import subprocess

    oasst = str(CHAT / "oasst" / "threads.messages.jsonl")
    (server,) = e2e_pool.get(1)
    args = ["--format", "speculators", "--max-length", str(OASST_MAX_LENGTH), "--max-samples", "24", "--seed", "3",
            "--input", oasst]
    shards = [tmp_path / f"sh{i}" for i in range(3)]
    for i, sh in enumerate(shards):
        summary = run_extract([server], sh, "--shard", f"{i}/3", *args)
        assert summary["status"] == "complete" and summary["dropped"] > 0, summary
    dropped = [json.loads((sh / "hsx_corpus.json").read_text())["dropped_indices"] for sh in shards]
    assert len({tuple(d) for d in dropped}) > 1, dropped  # what the merge used to compare

    out = tmp_path / "mrg"
    r = subprocess.run([*HSX, "merge", str(out), *map(str, shards), "--json", "--quiet"], capture_output=True,
                       text=True, timeout=300, env=cli_env())
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    n_dropped = sum(map(len, dropped))
    assert summary["samples"] == 24 - n_dropped and summary["dropped_in_shards"] == n_dropped
    assert corpus["counts"]["global_dropped"] == n_dropped and corpus["counts"]["truncated"] > 0
    starts = [json.loads((sh / "plan.json").read_text())["shard"]["start"] for sh in shards]
    assert corpus["merge"]["global_dropped_indices"] == sorted(s + i for s, d in zip(starts, dropped) for i in d)
    assert_verify_ok(out)
    requests = {s.key: s.request for s in read_samples([oasst], mask_policy="per_turn")}
    assert check_speculators_corpus(out, requests, OASST_MAX_LENGTH, "right") == 24 - n_dropped
    assert_files_say_only_true_things(out)


def test_files_that_name_their_shard_index_are_rewritten_without_it(tmp_path, inputs):
    """Issue 25 item 3 for shards written before sample files stopped naming their index
    (`index` in the safetensors metadata): the merge copies such a file without it, checked
    against the shard's checksum, records the new checksum, and the tensors stay the same."""
    import struct

    from safetensors.torch import load_file

    shards = make_shards(tmp_path, inputs, 2, max_samples=10)
    for sh in shards:  # make them look like an older client's shards
        lines = [json.loads(x) for x in (sh / "manifest.jsonl").read_text().splitlines()]
        for e in lines:
            (rel, meta), = e["files"].items()
            data = (sh / rel).read_bytes()
            n = struct.unpack("<Q", data[:8])[0]
            header = json.loads(data[8:8 + n])
            header["__metadata__"]["index"] = str(e["index"])
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-(8 + len(raw)) % 8)
            store.write_file_atomic(sh / rel, struct.pack("<Q", len(raw)) + raw + data[8 + n:])
            size, digest = store.hash_file(sh / rel)
            e["files"] = {rel: {"size": size, store.HASH_ALGO: digest}}
        (sh / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
        assert verify_corpus(sh)["ok"]
    out = tmp_path / "merged"
    r = run_merge(out, shards)
    assert r.exit_code == 0 and r.summary["rewritten"] == 10 and r.summary["linked"] == 0, r.summary
    assert_files_say_only_true_things(out)
    assert verify_corpus(out)["ok"]
    whole = {**samples_by_key(shards[0]), **samples_by_key(shards[1])}
    assert_same_samples(samples_by_key(out), whole)
    # a corrupted legacy file is caught by the shard's checksum while rewriting
    victim = shards[1] / "hidden_states" / "hs_1.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = run_merge(tmp_path / "merged2", shards)
    assert r.exit_code == 1 and "corrupted" in r.summary["message"] and str(victim) in r.summary["message"], r.summary
