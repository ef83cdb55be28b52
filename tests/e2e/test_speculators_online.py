"""Issue 15 end to end: speculators trains from hsx servers with no states on disk.

Real `hsx serve` processes (vLLM CPU, the trained stories260K in fp32, layers 1,2,4,5,
llama3 template, real OASST chats), `hsx extract` as a subprocess, and speculators 0.9's
own code: `create_train_val_loaders` (spawned DataLoader workers, its sampler, collator
and EAGLE-3 batch shift), `ArrowDataset`, hs_connectors' `FP8Transfer`, and its trainer
through `python -m hsx_client.training.speculators_train`. What is proven:
- `--states none` writes the full corpus's table, vocab files and order, with no engine
  pass (the servers' token counter does not move), crash-safe and resumable;
- online batches (the `hsx` backend over that table) equal the offline corpus's batches;
- a server SIGKILLed mid-epoch is failed over; rows that cannot be fetched follow
  --on-missing; servers that serve another model, or none, stop the run;
- the fp8 corpus loads through the fp8 backend, close to the full-precision states;
- a few optimizer steps of the EAGLE-3 draft run through the wrapper (`--device cpu` on a CPU).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from hsx_tools.server_process import read_metrics

from _e2e_helpers import (
    HSX,
    CliProcess,
    assert_each_index_once,
    assert_verify_ok,
    cli_env,
    extract_argv,
    run_extract,
    wait_for_manifest,
)
from _server import CHAT, STORIES

pytestmark = [pytest.mark.engine, pytest.mark.fixtures, pytest.mark.slow]

THREADS = CHAT / "oasst" / "threads.messages.jsonl"
CORPUS_ARGS = ["--format", "speculators", "--max-length", "256", "--truncation", "left", "--draft-vocab-size", "256"]
SEQ = 512  # speculators' total_seq_len: a few rows per packed batch


@pytest.fixture(scope="module")
def pool(e2e_pool):
    pytest.importorskip("speculators", reason="speculators 0.9 is not installed (scripts/install.sh --test)")
    return e2e_pool  # the failover test kills one, get() replaces it


def _tokens_served(url: str) -> float:
    return read_metrics(url).get("hsx_tokens_total")


def _requests_served(url: str) -> float:
    return read_metrics(url).get("hsx_requests_total", 0.0, status="ok")


@pytest.fixture(scope="module")
def corpora(pool, tmp_path_factory):
    """The same 20 real chats as a full corpus and as a token table (`--states none`)."""
    d = tmp_path_factory.mktemp("online")
    chats = d / "chats.jsonl"
    chats.write_text("".join(THREADS.read_text().splitlines(keepends=True)[:20]))
    servers = pool.get(2)
    run_extract(servers, d / "full", "--input", str(chats), *CORPUS_ARGS)
    before = [_tokens_served(s.url) for s in servers]
    summary = run_extract(servers, d / "tokens", "--input", str(chats), *CORPUS_ARGS, "--states", "none")
    assert summary["status"] == "complete" and summary["failed"] == 0
    assert [_tokens_served(s.url) for s in servers] == before, "--states none ran the engine"
    return {"chats": chats, "full": d / "full", "tokens": d / "tokens", "dir": d}


def _loaders(data: Path, transfer, *, workers: int = 2):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    return create_train_val_loaders(
        data_path=str(data), total_seq_len=SEQ, hidden_states_dtype=torch.float32, transfer=transfer,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path=str(STORIES),
        request_timeout=10, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=64, num_target_layers=3, num_workers=workers, prefetch_factor=2, preprocess=shift_batch,
        train_data_ratio=0.8, seed=0,
    )


def _hsx(data: Path, servers, **kw):
    from hsx_client.training.speculators_backend import HsxSettings, HsxTransfer

    return HsxTransfer(HsxSettings(servers=tuple(s if isinstance(s, str) else s.url for s in servers),
                                   data_path=str(data), **{"on_missing": "raise", **kw}))


def _assert_same_batch(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{where}: {k} differs"
        else:
            assert a[k] == b[k], f"{where}: {k} {a[k]!r} != {b[k]!r}"


def _offline_batches(corpora) -> dict[str, list[dict]]:
    if "batches" not in corpora:
        train, val = _loaders(corpora["full"], None)
        corpora["batches"] = {"train": list(train), "val": list(val)}
    return corpora["batches"]


# ----------------------------------------------------------------------------- the token table


def test_token_table_is_the_full_corpus_without_states(corpora):
    from datasets import load_from_disk

    full, tok = corpora["full"], corpora["tokens"]
    assert not (tok / "hidden_states").exists()
    a, b = load_from_disk(str(full)), load_from_disk(str(tok))
    assert len(a) == len(b) > 20
    for i in range(len(a)):
        for col in ("input_ids", "loss_mask", "seq_len"):
            assert torch.equal(a[i][col], b[i][col]), (i, col)
    for name in ("token_freq.pt", "d2t-256.npy", "t2d-256.npy"):
        assert (full / name).read_bytes() == (tok / name).read_bytes(), name
    corpus = json.loads((tok / "hsx_corpus.json").read_text())
    assert corpus["states"] == "none" and corpus["layer_ids"] == [1, 2, 4, 5]
    assert json.loads((tok / "hsx_format.json").read_text())["states"] == "none"
    assert_verify_ok(tok)
    disk = lambda d: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert disk(tok) < disk(full) / 10


def test_tokenize_answers_what_hidden_states_prefills(pool):
    from hsx.wire import decode

    url = pool.get(1)[0].url
    chat = [json.loads(x) for x in THREADS.read_text().splitlines()[:3]][2]["messages"]
    for body in ({"messages": chat, "assistant_mask": "last", "max_length": 64, "truncation": "left"},
                 {"prompt": "Once upon a time"}, {"input_ids": [1, 5, 9], "loss_mask": [0, 1, 1]}):
        tok = httpx.post(url + "/tokenize", json=body, timeout=60)
        assert tok.status_code == 200, tok.text
        full = decode(httpx.post(url + "/hidden_states", json=body, timeout=60).content)
        t = tok.json()
        assert t["token_ids"] == full.token_ids.tolist() and t["layer_ids"] == [1, 2, 4, 5]
        assert t["loss_mask"] == (None if full.loss_mask is None else full.loss_mask.tolist())
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and "no assistant turn" in r.json()["error"]["message"]
    r = httpx.post(url + "/tokenize", json={"input_ids": [1, 5, 9] * 200}, timeout=60)  # 600 > max_model_len
    assert r.status_code == 413 and r.json()["error"]["type"] == "too_large"


def test_states_none_run_resumes_after_sigkill(pool, tmp_path):
    servers = pool.get(1)
    out = tmp_path / "tokens"
    argv = extract_argv(servers, out, "--input", str(THREADS), *CORPUS_ARGS, "--states", "none",
                        "--concurrency-per-server", "1")
    cp = CliProcess(argv, tmp_path / "run.log")
    seen = wait_for_manifest(cp, out, 40)
    assert cp.kill() == -signal.SIGKILL, "the run ended before the kill"
    summary = run_extract(servers, out, "--input", str(THREADS), *CORPUS_ARGS, "--states", "none")
    assert summary["status"] == "complete" and summary["done"] > seen
    assert_each_index_once(out, summary["planned"])
    assert_verify_ok(out)


# ----------------------------------------------------------------------------- online = offline


def test_online_batches_equal_offline_batches(pool, corpora):
    servers = pool.get(2)
    offline = _offline_batches(corpora)
    train, val = _loaders(corpora["tokens"], _hsx(corpora["tokens"], servers))
    assert train.multiprocessing_context is not None and train.num_workers == 2  # spawned workers
    online = {"train": list(train), "val": list(val)}
    for split in ("train", "val"):
        assert len(online[split]) == len(offline[split]) > 0
        for n, (a, b) in enumerate(zip(offline[split], online[split])):
            _assert_same_batch(a, b, f"{split} batch {n}")
            assert b["error_records"] == 0
    served = [_requests_served(s.url) for s in servers]
    assert min(served) > 0, f"both servers should have served rows: {served}"


def test_rows_that_cannot_be_fetched_follow_on_missing(pool, tmp_path):
    import datasets
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    from hsx_client.training.speculators_backend import HsxSampleError, HsxSetupError

    servers = pool.get(1)
    rows = [[1, 5, 9, 13], [1, 5, 9] * 200, [1, 7, 9999]]  # fine; over max_model_len (413); outside the vocab
    table = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                                        "seq_len": [len(r) for r in rows]})
    table.set_format("torch")
    table.save_to_disk(str(tmp_path / "t"))

    def ds(**kw):
        return ArrowDataset(SEQ, str(tmp_path / "t"), transfer=_hsx(tmp_path / "t", servers, **kw),
                            on_missing=kw.get("on_missing", "raise"), train_ratio=1.0)

    d = ds(on_missing="raise")
    assert d[0]["hidden_states"].shape == (4, 3 * 64)
    with pytest.raises(HsxSampleError, match=r"row 1 .*413 too_large"):
        d[1]
    with pytest.raises(HsxSampleError, match=r"row 2 .*400 invalid_request: input id 9999 is outside the vocabulary"):
        ds(on_missing="generate")[2]
    assert isinstance(ds(on_missing="skip")[1], SampleUnavailable)
    with pytest.warns(UserWarning, match=r"row 2 .*vocabulary"):
        assert isinstance(ds(on_missing="warn")[2], SampleUnavailable)
    # infrastructure, not a row: raise whatever --on-missing says
    with pytest.raises(HsxSetupError, match="unreachable"):
        ArrowDataset(SEQ, str(tmp_path / "t"), transfer=_hsx(tmp_path / "t", ["http://127.0.0.1:9"],
                     on_missing="skip", max_attempts=2), on_missing="skip", train_ratio=1.0)[0]
    (tmp_path / "t" / "hsx_corpus.json").write_text(json.dumps({"model": "another/model"}))
    with pytest.raises(HsxSetupError, match="another/model"):
        ds(on_missing="skip")[0]
    (tmp_path / "t" / "hsx_corpus.json").write_text(json.dumps({"layer_ids": [0, 1, 2, 5]}))
    with pytest.raises(HsxSetupError, match="serve"):
        ds(on_missing="skip")[0]


# ----------------------------------------------------------------------------- fp8


def test_fp8_corpus_loads_through_speculators_fp8_backend(pool, corpora):
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    out = corpora["dir"] / "fp8"
    run_extract(pool.get(2), out, "--input", str(corpora["chats"]), *CORPUS_ARGS, "--dtype", "fp8")
    assert_verify_ok(out)
    full = ArrowDataset(SEQ, str(corpora["full"]), on_missing="raise", train_ratio=1.0)
    fp8 = ArrowDataset(SEQ, str(out), transfer=FP8Transfer(out / "hidden_states"), on_missing="raise", train_ratio=1.0)
    assert len(fp8) == len(full)
    for i in range(len(full)):
        a, b = full[i], fp8[i]
        assert isinstance(b, dict), f"speculators dropped fp8 sample {i}"
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for k in ("hidden_states", "verifier_last_hidden_states"):
            err = ((b[k].float() - a[k]).norm() / a[k].norm()).item()
            assert err < 0.05, f"sample {i} {k}: relative error {err}"
    states = lambda d: sum(p.stat().st_size for p in (d / "hidden_states").iterdir())  # noqa: E731
    assert states(out) < 0.3 * states(corpora["full"])  # fp32 served: 4 bytes -> 1 (+ a scale per token)


# ----------------------------------------------------------------------------- training


def _train_argv(data: Path, save: Path, servers) -> list[str]:
    """The documented command's flags (--device cpu sets the loss and attention a CPU runs)."""
    return ["--verifier-name-or-path", str(STORIES), "--data-path", str(data), "--save-path", str(save),
            "--hidden-states-backend", "hsx", "--hsx-servers", ",".join(s.url for s in servers),
            "--on-missing", "raise", "--total-seq-len", str(SEQ), "--num-workers", "2", "--prefetch-factor", "2",
            "--epochs", "1", "--max-steps", "2", "--train-data-ratio", "0.8", "--draft-vocab-size", "256",
            "--target-layer-ids", "1", "2", "4", "--logger", "", "--log-freq", "1", "--hidden-states-dtype", "float32"]


def test_eagle3_draft_trains_through_the_wrapper_on_cpu(pool, corpora, tmp_path):
    """Issue 25: `python -m hsx_client.training.speculators_train ... --device cpu` is the supported
    CPU route (it used to be a test file); without it a box with no GPU is told so at once."""
    servers = pool.get(2)
    env = cli_env()
    r = subprocess.run([sys.executable, "-m", "hsx_client.training.speculators_train", "--device", "cpu",
                        *_train_argv(corpora["tokens"], tmp_path / "ckpt", servers)],
                       capture_output=True, text=True, timeout=900, env=env)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"train/loss_0=([0-9.]+)", log)]
    assert len(losses) == 2 and all(x == x and x > 0 for x in losses), log[-4000:]
    assert (tmp_path / "ckpt" / "0" / "config.json").exists()
    assert "hsx_servers" in (tmp_path / "ckpt" / "run.yaml").read_text()
    if not torch.accelerator.is_available():
        r = subprocess.run([sys.executable, "-m", "hsx_client.training.speculators_train",
                            *_train_argv(corpora["tokens"], tmp_path / "ckpt2", servers)],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "no GPU (accelerator) found" in r.stderr and "--device cpu" in r.stderr, r.stderr[-3000:]
        assert not (tmp_path / "ckpt2").exists()


# ----------------------------------------------------------------------------- failover (last: it kills a server)


def test_server_sigkilled_mid_epoch_is_failed_over(pool, corpora):
    servers = pool.get(2)
    offline = _offline_batches(corpora)["train"]
    train, _ = _loaders(corpora["tokens"], _hsx(corpora["tokens"], servers, max_attempts=4))
    victim, survivor = servers
    got = []
    for n, batch in enumerate(train):
        got.append(batch)
        if n == 1:
            assert _requests_served(victim.url) > 0
            os.killpg(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(30)
            after_kill = _requests_served(survivor.url)
    assert len(got) == len(offline)
    for n, (a, b) in enumerate(zip(offline, got)):
        _assert_same_batch(a, b, f"train batch {n}")
    assert _requests_served(survivor.url) > after_kill
