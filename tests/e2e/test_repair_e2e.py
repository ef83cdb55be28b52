"""Issue 25 item 2 on a real engine and real data: a corpus of OASST chats at a max length
that drops samples (speculators renumbers its samples at finalize; SpecForge keeps holes),
one sample file corrupted; `hsx verify` names it, rerunning the same `hsx extract` redoes
exactly that sample and puts it where it was, `hsx verify` passes and the repaired file is
byte for byte the original. The fast, fake-server version is tests/client/corpus/test_repair_in_place.py.
Issue 36 item 3: the same for a merged corpus, whose files are hard links into its shards
(fast version: tests/client/corpus/test_merged_repair.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from _e2e_helpers import HSX, assert_verify_ok, cli_env, run_extract, verify
from _server import CHAT
from hsx_client.corpus import journal
from hsx_client.corpus.formats import get_format
from hsx_client.corpus.verify import compaction_moves

pytestmark = [pytest.mark.engine, pytest.mark.fixtures, pytest.mark.slow]

OASST = str(CHAT / "oasst" / "threads.messages.jsonl")
MAX_LENGTH = 500  # right truncation: about a quarter of the OASST rows keep no supervised token


@pytest.fixture(scope="module")
def server(e2e_pool):
    return e2e_pool.get(1)[0]


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_a_corrupted_sample_of_a_real_corpus_with_drops_is_repaired_in_place(server, tmp_path, fmt):
    args = ["--format", fmt, "--mask-policy", "per_turn", "--max-length", str(MAX_LENGTH), "--max-samples", "16",
            "--seed", "3", "--input", OASST]
    out = tmp_path / fmt
    first = run_extract([server], out, *args)
    assert first["dropped"] > 0, first
    corpus = json.loads((out / "hsx_corpus.json").read_text())
    moves = compaction_moves(out)
    assert bool(moves) == (fmt == "speculators"), moves
    f = get_format(fmt)
    path = f.hs_path if fmt == "speculators" else f.ckpt_path
    if moves:  # a sample finalize moved: the one repair in place used to refuse
        old, new = next(iter(moves.items()))
    else:
        old = new = min(set(range(16)) - set(corpus["dropped_indices"]))
    victim = out / path(new)
    original = victim.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x55
    victim.write_bytes(bytes(damaged))

    rc, report, err = verify(out)
    assert rc != 0 and [b["index"] for b in report["bad"]] == [old], (rc, report, err)
    assert path(new) in " ".join(report["bad"][0]["problems"])

    again = run_extract([server], out, *args)
    assert again["status"] == "complete" and again["samples_this_run"] == 1, again
    assert again["done"] == first["done"] and again["dropped"] == first["dropped"]
    assert victim.read_bytes() == original
    assert compaction_moves(out) == moves
    assert_verify_ok(out)


def test_a_corrupted_sample_of_a_real_merged_corpus_is_repaired_in_place(server, tmp_path):
    """Issue 36 item 3 as found: a merged sample file is a hard link to its shard's, so a byte
    flipped in it is in both. `hsx verify MERGED` names the sample and the shard; the advice it
    prints works: `hsx extract --output MERGED --server URL` (used to exit 2, "a merged corpus
    takes no more samples") extracts it again in place, byte for byte the original, and the
    shard's own file is never written through (still damaged: its own repair is its own)."""
    args = ["--format", "speculators", "--max-length", str(MAX_LENGTH), "--max-samples", "12", "--seed", "3",
            "--input", OASST]
    shards = [tmp_path / f"sh{i}" for i in range(2)]
    for i, sh in enumerate(shards):
        run_extract([server], sh, "--shard", f"{i}/2", *args)
    out = tmp_path / "merged"
    r = subprocess.run([*HSX, "merge", str(out), *map(str, shards), "--quiet"], capture_output=True, text=True,
                       timeout=300, env=cli_env())
    assert r.returncode == 0, r.stderr
    record = json.loads((out / "hsx_corpus.json").read_text())
    line = next(e for e in journal.read_jsonl(out / "manifest.jsonl")[0] if e["index"] == 1)
    (rel,) = line["files"]
    victim = out / rel
    shard = shards[line["shard"]]
    shard_file = next(p for p in (shard / "hidden_states").iterdir() if os.path.samefile(p, victim))
    original = victim.read_bytes()
    with open(victim, "r+b") as f:  # in place: both names see it
        f.seek(len(original) // 2)
        f.write(bytes([original[len(original) // 2] ^ 0x55]))
    damaged = shard_file.read_bytes()
    assert damaged != original

    rc, report, err = verify(out)
    assert rc == 1 and [b["index"] for b in report["bad"]] == [1], (rc, report, err)
    assert f"hsx extract --output {out}" in err and str(shard.resolve()) in err, err
    again = run_extract([server], out)  # the plan gives the inputs and settings
    assert again["status"] == "complete" and again["samples_this_run"] == 1, again
    assert victim.read_bytes() == original and shard_file.read_bytes() == damaged
    assert not os.path.samefile(victim, shard_file)
    after = json.loads((out / "hsx_corpus.json").read_text())
    assert after["merge"] == record["merge"] and after["counts"] == record["counts"]
    assert_verify_ok(out)
