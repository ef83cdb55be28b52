"""Issue 25 item 4: a corpus was made from its input files as they were; a rerun on the dir
(finished or not) whose inputs changed is refused, naming the file and what changed, even
when the edit touched only a field no request uses (the samples' fingerprint alone missed
that: "already complete", exit 0). Without an engine: the real client against the fake server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from hsx_client.corpus import extract as ex
from hsx_client.corpus import store
from hsx_client.settings import ClientSettings
from _shard_helpers import FakeHsx, extract, write_inputs


def rerun(out: Path, inputs: Path) -> ex.ExtractResult:
    cfg = ex.ExtractConfig(client=ClientSettings.given(["http://fake"]), output=out, inputs=[str(inputs)], format="speculators",
                           quiet=True, max_samples=6)
    return ex.run_extract(cfg, transport=httpx.MockTransport(FakeHsx()))


def edit_row(inputs: Path, n: int, change) -> None:
    lines = inputs.read_text().splitlines()
    row = json.loads(lines[n])
    change(row)
    lines[n] = json.dumps(row)
    inputs.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("finished", [True, False])
@pytest.mark.parametrize("edit, words", [
    (lambda row: row.update(note="reviewed"), "only fields no request uses changed"),
    (lambda row: row["input_ids"].__setitem__(0, (row["input_ids"][0] + 1) % 64), "the samples read from them differ"),
])
def test_a_changed_input_file_is_refused_on_every_rerun(tmp_path, edit, words, finished):
    inputs = write_inputs(tmp_path / "in.jsonl", 10)
    out = tmp_path / "corpus"
    extract(out, inputs, max_samples=6)
    if not finished:
        (out / store.CORPUS_NAME).unlink()
    pristine = inputs.read_bytes()
    edit_row(inputs, 3, edit)
    r = rerun(out, inputs)
    assert r.exit_code == 2 and r.status == "refused", r.summary
    msg = r.summary["message"]
    assert f"input {inputs} changed" in msg and words in msg and "new --output" in msg, msg
    assert (out / store.CORPUS_NAME).exists() == finished, "a refused rerun changes nothing"
    inputs.write_bytes(pristine)  # as it was: the run goes on
    r = rerun(out, inputs)
    assert r.exit_code == 0, r.summary
    assert (r.summary.get("message") == "already complete") == finished


def test_moved_inputs_are_the_same_a_removed_one_is_named(tmp_path):
    inputs = write_inputs(tmp_path / "in.jsonl", 10)
    out = tmp_path / "corpus"
    extract(out, inputs, max_samples=6)
    plan = json.loads((out / "plan.json").read_text())
    assert [f["path"] for f in plan["input_files"]] == [str(inputs)]
    (tmp_path / "mnt").mkdir()
    moved = inputs.rename(tmp_path / "mnt" / "in.jsonl")  # the same file, mounted elsewhere
    assert rerun(out, moved).exit_code == 0
    inputs = moved.rename(inputs)
    other = write_inputs(tmp_path / "other.jsonl", 11)  # another file, other rows
    cfg = ex.ExtractConfig(client=ClientSettings.given(["http://fake"]), output=out, inputs=[str(other)], format="speculators",
                           quiet=True, max_samples=6)
    r = ex.run_extract(cfg, transport=httpx.MockTransport(FakeHsx()))
    assert r.exit_code == 2 and f"{inputs} is gone" in r.summary["message"] and f"{other} is new" in r.summary["message"]


def test_a_dataset_directory_counts_its_data_files_only(tmp_path):
    """Files a reader may write beside the data (hidden ones, datasets' cache-*.arrow) are
    not the input: they would make every rerun look changed."""
    from hsx_client.corpus.plan import changed_inputs, input_files

    d = tmp_path / "ds"
    (d / "train").mkdir(parents=True)
    (d / "train" / "data-00000.arrow").write_bytes(b"rows")
    before = input_files([str(d)])
    assert [Path(f["path"]).name for f in before] == ["data-00000.arrow"]
    (d / ".cache").mkdir()
    (d / ".cache" / "lock").write_text("x")
    (d / "train" / "cache-123.arrow").write_bytes(b"mapped")
    assert changed_inputs(before, input_files([str(d)])) == []
    (d / "train" / "data-00000.arrow").write_bytes(b"rowz")
    assert changed_inputs(before, input_files([str(d)])) == [f"{d / 'train' / 'data-00000.arrow'} changed: same size "
                                                              "(4 bytes), other content"]
