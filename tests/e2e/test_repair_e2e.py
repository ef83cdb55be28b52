"""Issue 25 item 2 on a real engine and real data: a corpus of OASST chats at a max length
that drops samples (speculators renumbers its samples at finalize; SpecForge keeps holes),
one sample file corrupted; `hsx verify` names it, rerunning the same `hsx extract` redoes
exactly that sample and puts it where it was, `hsx verify` passes and the repaired file is
byte for byte the original. The fast, fake-server version is tests/client/corpus/test_repair_in_place.py."""

from __future__ import annotations

import json

import pytest

from _e2e_helpers import assert_verify_ok, run_extract, verify
from _server import CHAT
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
