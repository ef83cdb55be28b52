"""Issue 25 item 5: a corpus's records name files by relative path; a tampered record
(an absolute path, `..`, a symlink that leads out) must never make `hsx verify`, a resumed
`hsx extract` or `hsx merge` open, hash or link a file outside the corpus directory.
Without an engine: the real client and formats against the in-process fake server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hsx_client.corpus import journal, store
from hsx_client.corpus import verify as verify_mod
from hsx_client.corpus.merge import run_merge
from hsx_client.corpus.verify import verify_corpus
from _shard_helpers import FakeHsx, extract, write_inputs

import httpx

from hsx_client.corpus import extract as ex
from hsx_client.settings import ClientSettings


@pytest.fixture
def inputs(tmp_path) -> Path:
    return write_inputs(tmp_path / "in.jsonl", 12)


def rewrite_manifest_files(out: Path, index: int, files: dict) -> None:
    p = out / store.MANIFEST_NAME
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    for e in lines:
        if e.get("index") == index:
            e["files"] = files
    p.write_text("".join(json.dumps(e) + "\n" for e in lines))


def outside_copy(tmp_path: Path, corpus: Path, rel: str) -> Path:
    """The same bytes as the corpus file `rel`, outside the corpus (so size and checksum match)."""
    dst = tmp_path / "elsewhere" / Path(rel).name
    dst.parent.mkdir(exist_ok=True)
    shutil.copyfile(corpus / rel, dst)
    return dst


@pytest.fixture
def opened(monkeypatch) -> list[Path]:
    """Every path verify hashes."""
    seen: list[Path] = []
    real = store.hash_file

    def spy(path, *a, **kw):
        seen.append(Path(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(store, "hash_file", spy)
    return seen


def test_inside_refuses_absolute_dotdot_and_symlinks_out(tmp_path):
    root = tmp_path / "c"
    (root / "d").mkdir(parents=True)
    (tmp_path / "secret").write_text("x")
    (root / "d" / "in.bin").write_text("y")
    (root / "d" / "link_in").symlink_to(root / "d" / "in.bin")
    (root / "d" / "link_out").symlink_to(tmp_path / "secret")
    (root / "up").symlink_to(tmp_path)
    assert store.inside(root, "d/in.bin") == root / "d" / "in.bin"
    assert store.inside(root, "d/link_in") == root / "d" / "link_in"
    for rel, words in ((str(tmp_path / "secret"), "not a path inside"), ("../secret", "not a path inside"),
                       ("d/../../secret", "not a path inside"), ("", "not a path inside"),
                       ("d/link_out", "outside the corpus"), ("up/secret", "outside the corpus")):
        with pytest.raises(store.UnsafePathError, match=words):
            store.inside(root, rel)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_verify_never_reads_a_file_outside_the_corpus(tmp_path, inputs, opened, how):
    out = tmp_path / "corpus"
    extract(out, inputs, max_samples=6)
    entries, _, _ = journal.read_jsonl(out / store.MANIFEST_NAME)
    e = journal.latest_by_index(entries)[2]
    (rel, meta), = e["files"].items()
    far = outside_copy(tmp_path, out, rel)
    if how == "absolute":
        rewrite_manifest_files(out, 2, {str(far): meta})
    elif how == "dotdot":
        rewrite_manifest_files(out, 2, {"../elsewhere/" + far.name: meta})
    else:  # the recorded name, but the file is a symlink to the same bytes elsewhere
        (out / rel).unlink()
        (out / rel).symlink_to(far)
    opened.clear()
    report = verify_corpus(out)
    assert not report["ok"] and [b["index"] for b in report["bad"]] == [2], report
    assert any("outside the corpus" in p or "not a path inside" in p for p in report["bad"][0]["problems"])
    assert not [p for p in opened if not p.resolve().is_relative_to(out.resolve())], opened


def test_a_finalize_output_outside_the_corpus_is_a_problem(tmp_path, inputs, opened):
    out = tmp_path / "corpus"
    extract(out, inputs, max_samples=6)
    p = out / store.CORPUS_NAME
    corpus = json.loads(p.read_text())
    corpus["finalize_files"]["/etc/hostname"] = {"size": 1, "xxh3_128": "0"}
    p.write_text(json.dumps(corpus))
    opened.clear()
    report = verify_corpus(out)
    assert any("/etc/hostname" in x and "not a path inside" in x for x in report["problems"]), report
    assert Path("/etc/hostname") not in opened


def test_resume_refuses_a_manifest_that_leads_outside(tmp_path, inputs):
    out = tmp_path / "corpus"
    extract(out, inputs, max_samples=6)
    (out / store.CORPUS_NAME).unlink()  # not finished: the rerun would check and reuse the samples
    entries, _, _ = journal.read_jsonl(out / store.MANIFEST_NAME)
    (rel, meta), = journal.latest_by_index(entries)[1]["files"].items()
    rewrite_manifest_files(out, 1, {str(outside_copy(tmp_path, out, rel)): meta})
    cfg = ex.ExtractConfig(client=ClientSettings.given(["http://fake"]), output=out, inputs=[str(inputs)], format="speculators",
                           quiet=True, max_samples=6)
    r = ex.run_extract(cfg, transport=httpx.MockTransport(FakeHsx()))
    assert r.exit_code == 2 and "manifest line for index 1 names a file outside" in r.summary["message"], r.summary
    assert not (out / store.CORPUS_NAME).exists()


def test_merge_refuses_a_shard_file_that_is_a_symlink_out(tmp_path, inputs):
    shards = []
    for i in range(2):
        shards.append(tmp_path / f"s{i}")
        extract(shards[-1], inputs, shard=(i, 2), max_samples=8)
    rel = "hidden_states/hs_1.safetensors"
    far = outside_copy(tmp_path, shards[1], rel)
    (shards[1] / rel).unlink()
    (shards[1] / rel).symlink_to(far)  # same bytes: sizes and checksums would pass
    out = tmp_path / "merged"
    r = run_merge(out, shards)
    assert r.exit_code == 2 and any("leads outside the corpus" in p for p in r.summary["problems"]), r.summary
    assert not (out / "plan.json").exists() and not list(out.rglob("*.safetensors"))
