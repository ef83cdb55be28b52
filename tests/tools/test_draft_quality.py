"""Issue 30's measurement, bench/draft_quality.py: its training half on CPU in CI.

The engine test runs the script itself (`--no-acceptance`: no vLLM engine of its own) on
the session-shared e2e servers (fp32 stories260K, layers 1,2,4,5, llama3 template) with 20
real chats: `hsx extract` writes the offline corpus and the token table, speculators'
trainer (`python -m hsx_client.training.speculators_train --device cpu`) trains the same tiny EAGLE-3
draft from each, with one seed. Proven: the loss falls in both, and the online run's loss
curve is the offline run's (same seed, same batches: tests/test_speculators_online.py
proves the batches equal; here the trainer sees them). The acceptance half needs engines
with speculative decoding: it runs on the H200 (tests/gpu/session.sh draft) and by hand
on CPU (bench/README.md). The fast tests cover the report's arithmetic.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import draft_engines  # noqa: E402
import draft_quality  # noqa: E402


# ----------------------------------------------------------------------------- fast: the report


def test_acceptance_from_vllm_counters():
    metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
               SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=30),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=12),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[7, 4, 1]),
               SimpleNamespace(name="vllm:prompt_tokens", value=99)]
    got = draft_engines.acceptance(metrics)
    assert got["mean_acceptance_length"] == pytest.approx(2.2)  # 1 + 12 accepted / 10 drafts
    assert got["acceptance_rate"] == pytest.approx(0.4)
    assert got["acceptance_rate_per_position"] == pytest.approx([0.7, 0.4, 0.1])
    assert draft_engines.acceptance([])["mean_acceptance_length"] is None  # no drafts: no figure, no division


def test_loss_curve_reads_speculators_wrapped_log_lines():
    log = ("[13:00:03] INFO     train/loss_0=4.937, train/full_acc_0=0.005,   trainer.py:587\n"
           "                    train/loss_1=4.5, train/lr=0.001, train/loss=9.437\n"
           "noise val/loss_0=1.0\n[13:00:05] INFO     train/loss_0=4.0, train/loss_1=nan,\n")
    assert draft_quality.loss_curve(log) == [{"loss_0": 4.937, "full_acc_0": 0.005, "loss_1": 4.5, "loss": 9.437},
                                             {"loss_0": 4.0, "loss_1": pytest.approx(float("nan"), nan_ok=True)}]


def test_summary_means_seeds_and_states_their_spread():
    def run(mal, pos, loss):
        return {"acceptance": {"mean_acceptance_length": mal, "acceptance_rate_per_position": pos},
                "loss_curve": [{"loss_0": 9.0}, {"loss_0": loss}]}

    got = draft_quality.summarize({"offline": {0: run(2.0, [0.6, 0.3], 3.0), 1: run(2.2, [0.8, 0.5], 5.0)}})
    s = got["offline"]
    assert s["mean_acceptance_length"] == pytest.approx(2.1) and s["seed_spread"] == pytest.approx(0.2)
    assert s["acceptance_rate_per_position"] == pytest.approx([0.7, 0.4]) and s["final_loss_0"] == 4.0


def test_split_keeps_heldout_prompts_out_of_training(tmp_path):
    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "system", "content": "s"},
                                                      {"role": "user", "content": f"q{i}"},
                                                      {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                             for i in range(5)))
    train, held = draft_quality.split_chats(chats, 3, 2)
    assert [json.loads(x)["messages"][1]["content"] for x in train] == ["q0", "q1", "q2"]
    assert [[m["content"] for m in p] for p in held] == [["s", "q3"], ["s", "q4"]]  # up to the first user turn
    with pytest.raises(SystemExit, match="fewer than"):
        draft_quality.split_chats(chats, 4, 2)


def test_regenerated_run_needs_its_chats(tmp_path):
    with pytest.raises(SystemExit):
        draft_quality.parse_args(["--out", "x.json", "--runs", "offline,regenerated"])
    a = draft_quality.parse_args(["--out", "x.json", "--regenerated", str(tmp_path / "regen.jsonl")])
    assert a.runs == ["offline", "online", "reference", "regenerated"]
    a = draft_quality.parse_args(["--out", "x.json", "--runs", "offline", "--regenerate"])  # made by the run
    assert a.runs == ["offline", "regenerated"] and a.regenerate and a.regenerated is None
    with pytest.raises(SystemExit):  # made here or read from a file, not both
        draft_quality.parse_args(["--out", "x.json", "--regenerate", "--regenerated", str(tmp_path / "r.jsonl")])


def test_timings_survive_a_rerun(tmp_path):
    """A run cut short by the device call's limit is continued by the next call: the first
    call's seconds per step stay in the report."""
    first = draft_quality.Timings(tmp_path / "timings.json")
    first["serve_start_s"] = 41.234
    second = draft_quality.Timings(tmp_path / "timings.json")
    second["accept_no-draft_s"] = 30.0
    assert draft_quality.Timings(tmp_path / "timings.json") == {"serve_start_s": 41.23, "accept_no-draft_s": 30.0}


def test_reference_waits_for_the_connectors_write(tmp_path):
    """vLLM's file connector reports a request finished once its states are out of the KV
    cache; a writer thread writes the file after that and then releases the exclusive lock
    on `PATH.lock` that the worker took before the path was returned (the stock connector's
    protocol, its CPU twin's too). A reader that takes the file at once finds none: the
    reference step stopped with FileNotFoundError on a two-row table."""
    path = tmp_path / "0-abc.safetensors"
    lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # the worker, before the client gets the path

    def write():  # the connector's writer thread: the file, then the lock released
        time.sleep(0.3)
        path.write_bytes(b"states")
        os.close(lock_fd)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        kept = draft_engines.keep_states(str(path), tmp_path / "hs_0.safetensors")
    finally:
        writer.join()
    assert kept.read_bytes() == b"states"
    assert not path.exists() and not Path(f"{path}.lock").exists()  # moved, and the lock file gone with it


@pytest.mark.slow  # importing datasets takes seconds
def test_epochs_are_just_enough_for_the_steps(tmp_path):
    """speculators' --max-steps ends only the epoch it is reached in; each later epoch runs a step."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"seq_len": [100] * 40}).save_to_disk(str(tmp_path / "t"))
    # 40 x 100 tokens, 95 % for training: at least 7 packed batches of 512 tokens per epoch
    assert [draft_quality.epochs_for(tmp_path / "t", k, 512, 0.95) for k in (1, 7, 8, 20)] == [1, 1, 2, 3]


@pytest.mark.slow  # importing matplotlib takes seconds (where it is installed)
def test_plot_draws_both_panels(tmp_path):
    pytest.importorskip("matplotlib")
    run = {"loss_curve": [{"loss_0": 5.0}, {"loss_0": 4.0}],
           "acceptance": {"mean_acceptance_length": 1.5, "acceptance_rate_per_position": [0.4, 0.1]}}
    report = {"label": "t", "runs": {"offline": {"0": run}}, "summary": draft_quality.summarize({"offline": {0: run}})}
    assert draft_quality.plot(report, tmp_path / "p.png") is None
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- the training half, real


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.fixtures
def test_hsx_offline_and_online_drafts_train_alike_on_cpu(e2e_pool, tmp_path):
    if importlib.util.find_spec("speculators") is None:  # not imported here: the trainer is a child process
        pytest.skip("speculators 0.9 is not installed (scripts/install.sh --test)")
    (server,) = e2e_pool.get(1)
    out = tmp_path / "draft.json"
    steps = 6
    rc = draft_quality.main([
        "--server", server.url, "--no-acceptance", "--runs", "offline,online", "--device", "cpu",
        "--train-chats", "20", "--heldout", "1", "--steps", str(steps), "--seeds", "0", "--total-seq-len", "512",
        "--num-workers", "0",  # no spawned DataLoader workers to start (test_speculators_online has them)
        "--train-arg=--lr=3e-3", "--workdir", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    curves = {name: report["runs"][name]["0"]["loss_curve"] for name in ("offline", "online")}
    for name, curve in curves.items():
        losses = [step["loss_0"] for step in curve]
        assert len(losses) == steps and all(x == x for x in losses), (name, losses)
        assert sum(losses[-2:]) < sum(losses[:2]), f"{name}: the loss did not fall: {losses}"
    for a, b in zip(curves["offline"], curves["online"]):  # same seed, same batches: the same training
        assert a == pytest.approx(b, rel=1e-4), curves
