"""Issue 39 end to end: `hsx extract --draft` against real `hsx serve` processes (the shared
e2e servers: fp32 stories260K, layers 1,2,4,5, N = 5): a draft the served layers do not fit
is refused before any sample; MTP (speculators) and DSpark (SpecForge) corpora of a layer
subset are complete, pass `hsx verify`, and load in the trainers' own readers; a DFlash draft
trains online from a `--states none` table through the `hsx` backend (docs/online-training.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from _corpus_helpers import specforge_rows
from _e2e_helpers import assert_verify_ok, cli_env, extract_argv, run_cli, run_extract
from _server import CHAT, STORIES

pytestmark = [pytest.mark.engine, pytest.mark.fixtures, pytest.mark.slow]

OASST = str(CHAT / "oasst" / "threads.messages.jsonl")
BASE = ["--input", OASST, "--max-length", "256", "--max-samples", "6"]


@pytest.fixture(scope="module")
def pool(e2e_pool):
    for mod in ("speculators", "specforge"):
        pytest.importorskip(mod)
    return e2e_pool


def test_a_draft_the_served_layers_do_not_fit_is_refused_at_once(pool, tmp_path):
    out = tmp_path / "never"
    r = run_cli(extract_argv(pool.get(1), out, "--format", "speculators", "--draft", "mtp", *BASE))
    assert r.returncode == 2 and "--draft mtp" in r.stderr and "pass --layers 5 " in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_mtp_corpus_of_the_last_layer_loads_in_speculators(pool, tmp_path):
    data = pytest.importorskip("speculators.train.data")
    out = tmp_path / "mtp"
    s = run_extract(pool.get(1), out, "--format", "speculators", "--draft", "mtp", "--layers", "5", *BASE)
    assert s["status"] == "complete" and s["done"] > 0
    facts = json.loads((out / "hsx_format.json").read_text())
    assert facts["draft"] == "mtp" and facts["layer_ids"] == [5]
    assert_verify_ok(out)
    ds = data.ArrowDataset(4096, str(out), on_missing="raise", train_ratio=1.0)
    assert len(ds) == s["done"]
    row = ds[0]
    assert row["hidden_states"].shape[1] == 0 and row["verifier_last_hidden_states"].shape[1] == 64


def test_dspark_corpus_loads_in_specforges_dspark_provider(pool, tmp_path):
    out = tmp_path / "dspark"
    s = run_extract(pool.get(1), out, "--format", "specforge", "--mask-policy", "all_turns", "--draft", "dspark",
                    "--layers", "4,5", *BASE)
    assert s["status"] == "complete" and s["done"] > 0
    assert json.loads((out / "hsx_format.json").read_text())["trainer_layers"]["target_layer_ids"] == [3]
    assert_verify_ok(out)
    rows = specforge_rows(out, "dspark")
    assert len(rows) == s["done"]
    for t in rows.values():
        assert t["hidden_states"].shape[-1] == 64 and t["target_last_hidden_states"].shape[-1] == 64
        assert torch.isfinite(t["target_last_hidden_states"]).all()


def test_a_dflash_draft_trains_online_from_a_token_table(pool, tmp_path):
    """docs/online-training.md, "Other drafts": `--states none --draft dflash` on a layer subset,
    then speculators' DFlash trained through the wrapper, every row's K + 1 layers fetched from
    the server (a subset of what it serves: the backend asks for them by id)."""
    pytest.importorskip("hs_connectors")
    servers = pool.get(1)
    data = tmp_path / "dflash"
    s = run_extract(servers, data, "--format", "speculators", "--draft", "dflash", "--layers", "2,4,5",
                    "--states", "none", "--draft-vocab-size", "256", *BASE)
    assert s["status"] == "complete" and s["done"] > 0 and not (data / "hidden_states").exists()
    assert json.loads((data / "hsx_format.json").read_text())["trainer_layers"]["flag"] == "--target-layer-ids 2 4"
    argv = [sys.executable, "-m", "hsx_client.training.speculators_train", "--device", "cpu",
            "--speculator-type", "dflash", "--num-layers", "1", "--block-size", "4",
            "--verifier-name-or-path", str(STORIES), "--data-path", str(data), "--save-path", str(tmp_path / "ckpt"),
            "--hidden-states-backend", "hsx", "--hsx-servers", servers[0].url, "--on-missing", "raise",
            "--total-seq-len", "512", "--num-workers", "0", "--epochs", "1", "--max-steps", "2",
            "--train-data-ratio", "0.8", "--draft-vocab-size", "256", "--target-layer-ids", "2", "4",
            "--logger", "", "--log-freq", "1", "--hidden-states-dtype", "float32"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=cli_env())
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"train/loss=([0-9.]+)", log)]
    # six rows pack into one or two batches of 512 tokens: the epoch ends at its last one
    assert 1 <= len(losses) <= 2 and all(x == x and x > 0 for x in losses), log[-4000:]
    assert re.search(r"val/loss_epoch=[0-9.]+", log), log[-4000:]
    assert (tmp_path / "ckpt" / "0" / "config.json").exists()
