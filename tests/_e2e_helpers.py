"""Helpers for the client end-to-end tests: `hsx extract` / `hsx verify` as subprocesses,
manifest polling, expected token ids, and the trainers' own corpus readers."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from _corpus_helpers import specforge_batches as read_specforge
from _reference import load as load_reference_model
from _reference import per_layer_rel_err, reference_states
from _server import STORIES, TEMPLATES, ServerProcess, engine_env

LAYERS = [1, 2, 4, 5]  # stories260K has N = 5 layers; 5 is the pre-norm last state
HIDDEN = 64
FP32_TOL = 1e-4
TEMPLATE = TEMPLATES / "llama3.jinja"
HSX = [sys.executable, "-m", "hsx_tools.cli"]


# ----------------------------------------------------------------------------- servers


class ServerPool:
    """Real `hsx serve` processes (fp32 stories260K, layers 1,2,4,5, llama3 template),
    started in parallel on demand; a killed one is replaced by a fresh one when asked."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[ServerProcess] = []
        self._n = 0

    def _spawn(self) -> ServerProcess:
        self._n += 1
        return ServerProcess(
            str(STORIES), "--dtype", "float32", "--layers", ",".join(map(str, LAYERS)),
            "--chat-template", str(TEMPLATE), "--max-num-seqs", "16",
            # Compiled: the modules on these servers compare corpora of separate runs
            # bitwise; eager CPU fp32 states moved by ~3e-7 with the batch's make-up.
            log_dir=self.log_dir, name=f"e2e{self._n}", compiled=True,
        )

    def get(self, k: int) -> list[ServerProcess]:
        alive = [s for s in self.procs if s.proc.poll() is None]
        new = [self._spawn() for _ in range(max(0, k - len(alive)))]
        self.procs += new
        for s in new:
            s.wait_ready()
        return (alive + new)[:k]

    def stop_all(self) -> None:
        for s in self.procs:
            s.stop()


# ----------------------------------------------------------------------------- CLI


def cli_env() -> dict[str, str]:
    env = engine_env()
    for k in ("HSX_SERVER", "HSX_API_KEY", "HSX_CONCURRENCY_PER_SERVER", "HSX_TIMEOUT", "HSX_MAX_ATTEMPTS"):
        env.pop(k, None)
    return env


def extract_argv(servers, out: Path, *args: str) -> list[str]:
    argv = [*HSX, "extract"]
    for s in servers:
        argv += ["--server", s if isinstance(s, str) else s.url]
    return argv + ["--output", str(out), "--quiet", *args]


def run_cli(argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=cli_env())


def run_extract(servers, out: Path, *args: str, timeout: float = 240) -> dict:
    r = run_cli(extract_argv(servers, out, "--json", *args), timeout=timeout)
    assert r.returncode == 0, f"hsx extract exited {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def verify(out: Path) -> tuple[int, dict, str]:
    r = run_cli([*HSX, "verify", str(out), "--json", "--quiet"])
    report = json.loads(r.stdout) if r.stdout.strip() else {}
    return r.returncode, report, r.stderr


def assert_verify_ok(out: Path) -> dict:
    rc, report, err = verify(out)
    assert rc == 0 and report["ok"], f"hsx verify failed ({rc}):\n{err[-3000:]}"
    assert report["missing"] == 0 and report["bad_samples"] == 0 and report["failed"] == 0
    return report


class CliProcess:
    """`hsx extract` in its own session (so SIGKILL of its group leaves nothing behind)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.out_path = log.with_name(log.name + ".stdout")
        self._f = open(log, "ab")
        self._o = open(self.out_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._o, stderr=self._f, env=cli_env(),
                                     start_new_session=True)

    def _close(self) -> None:
        self._f.close()
        self._o.close()

    def kill(self) -> int:
        """SIGKILL the whole group; returns the exit status (-9 when it was still running)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rc = self.proc.wait(30)
        self._close()
        return rc

    def wait(self, timeout: float = 240) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
            self._close()
        return rc

    def output(self) -> str:
        """stderr (of every run logged here) and this run's stdout."""
        return self.log.read_text(errors="replace") + self.stdout()

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")


def manifest_lines(out: Path) -> list[dict]:
    """Complete manifest lines (a torn last line, as a kill can leave, is not counted)."""
    p = out / "manifest.jsonl"
    if not p.exists():
        return []
    data = p.read_bytes()
    lines = data.split(b"\n")[:-1]  # the part after the last newline is torn (or empty)
    res = []
    for line in lines:
        if line.strip():
            try:
                res.append(json.loads(line))
            except ValueError:
                pass
    return res


def stored_indices(out: Path) -> list[int]:
    return [int(e["index"]) for e in manifest_lines(out) if not e.get("invalid")]


def wait_for_manifest(cp: CliProcess, out: Path, n: int, timeout: float = 120) -> int:
    """Poll until the manifest holds >= n stored samples (a file read every 20 ms: the
    kill points want to be close); returns the count seen. The process must still be
    running then, else the kill point was missed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        k = len(stored_indices(out))
        if k >= n:
            return k
        if cp.proc.poll() is not None:
            raise AssertionError(f"hsx extract exited ({cp.proc.returncode}) before {n} samples were stored:\n"
                                 + cp.output()[-3000:])
        time.sleep(0.02)
    raise AssertionError(f"manifest did not reach {n} samples in {timeout}s")


def assert_each_index_once(out: Path, n: int) -> None:
    """Every planned index stored, and no index stored twice (no invalidations happened)."""
    lines = manifest_lines(out)
    assert not [e for e in lines if e.get("invalid")], "unexpected invalidated samples"
    counts = Counter(int(e["index"]) for e in lines)
    dup = {i: c for i, c in counts.items() if c != 1}
    assert not dup, f"samples stored more than once: {dup}"
    assert set(counts) == set(range(n)), f"missing: {sorted(set(range(n)) - set(counts))}"
    assert not list(out.rglob("*.hsx-tmp-*")), "temporary files left behind"


def plan_keys(out: Path) -> list[str]:
    return json.loads((out / "plan.json").read_text())["keys"]


# ----------------------------------------------------------------------------- expectations


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(STORIES))


def render_ids(request: dict) -> list[int]:
    """What the server must have tokenized for a request (independent of the server)."""
    tok = tokenizer()
    if "input_ids" in request:
        return list(request["input_ids"])
    if "prompt" in request:
        return list(tok(request["prompt"], add_special_tokens=True)["input_ids"])
    text = tok.apply_chat_template(request["messages"], tools=request.get("tools"),
                                   chat_template=TEMPLATE.read_text(), tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def truncate(ids: list[int], max_length: int, side: str) -> list[int]:
    if len(ids) <= max_length:
        return ids
    return ids[-max_length:] if side == "left" else ids[:max_length]


def _squash(s: str) -> str:
    return "".join(s.split())


def mask_runs(mask) -> list[tuple[int, int]]:
    m = np.asarray(mask).astype(bool)
    runs, start = [], None
    for i, v in enumerate(m):
        if v and start is None:
            start = i
        if not v and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(m)))
    return runs


def check_chat_mask(request: dict, ids: list[int], mask, truncated: bool) -> None:
    """The supervised tokens are assistant text (and its end-of-turn marker), never the
    user's; under `assistant_mask: last` exactly one run, the last assistant turn."""
    tok = tokenizer()
    msgs = request["messages"]
    assistants = [m["content"] for m in msgs if m["role"] == "assistant"]
    runs = mask_runs(mask)
    if request.get("assistant_mask") == "last":
        targets = [_squash(assistants[-1] + "<|eot_id|>")]
        assert len(runs) == 1 or (truncated and len(runs) <= 1), f"per-turn mask has runs {runs}"
    else:
        targets = [_squash(a + "<|eot_id|>") for a in assistants]
        assert 1 <= len(runs) <= len(assistants) or truncated, f"mask runs {runs} for {len(assistants)} turns"
    for s, e in runs:
        text = _squash(tok.decode(ids[s:e]))
        core = text[2:-2] if len(text) > 6 else text
        assert any(core in t for t in targets), f"supervised text {text[:80]!r}... is no assistant turn"
        if not truncated and request.get("assistant_mask") == "last":
            assert len(text) >= len(targets[0]) - 4, f"last turn only partly supervised: {text[:80]!r}"


def expected_sample(request: dict, ids: list[int], mask, max_length: int, side: str) -> None:
    full = render_ids(request)
    want = truncate(full, max_length, side)
    assert ids == want, f"token ids differ from the rendered request ({len(ids)} vs {len(want)})"
    mask = np.asarray(mask).astype(np.int64)
    if "input_ids" in request:
        given = request.get("loss_mask")
        if given is not None:
            assert mask.tolist() == truncate(list(given), max_length, side)
        else:
            assert mask.all()
    elif "prompt" in request:
        assert mask.all(), "a plain prompt has no mask: every token is supervised"
    else:
        check_chat_mask(request, ids, mask, truncated=len(full) > max_length)


@functools.lru_cache(maxsize=512)
def _reference(ids: tuple[int, ...]) -> torch.Tensor:
    return reference_states(str(STORIES), list(ids), LAYERS)


def reference(ids: list[int]) -> torch.Tensor:
    """transformers' [T, 4, H] float32 states of layers 1, 2, 4 and 5 (pre-norm)."""
    return _reference(tuple(int(t) for t in ids))


def check_states(ids: list[int], states: torch.Tensor) -> list[float]:
    """states [T, 4, H] (last pre-norm) against transformers, fp32 tolerance per layer."""
    ref = reference(ids)
    errs = per_layer_rel_err(states, ref)
    assert max(errs) < FP32_TOL, f"relative error per layer {dict(zip(LAYERS, errs))}"
    return errs


@torch.no_grad()
def postnorm_reference(ids: list[int]) -> torch.Tensor:
    model = load_reference_model(str(STORIES))
    return model.model.norm(reference(ids)[:, 3])


# ----------------------------------------------------------------------------- trainers' readers


def speculators_rows(out: Path, max_len: int = 512) -> list[dict]:
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(max_len, str(out), on_missing="raise", train_ratio=1.0)
    rows = [ds[i] for i in range(len(ds))]
    dropped = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
    assert not dropped, f"speculators dropped samples {dropped}"
    return rows


def specforge_batches(out: Path, max_len: int = 512) -> dict[int, dict]:
    """SpecForge 0.2's own reader over the corpus: {sample index (from the file name): batch}."""
    res: dict[int, dict] = {}
    for path, tensors in read_specforge(out, max_len, run_id="e2e"):
        i = int(Path(path).name[len("data_"):-len(".ckpt")])
        assert i not in res, f"SpecForge read sample {i} twice"
        res[i] = tensors
    return res


def dropped_indices(out: Path) -> set[int]:
    """Planned samples dropped by policy (no supervised token after truncation)."""
    p = out / "failed.jsonl"
    lines = [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
    return {e["index"] for e in lines if e.get("kind") == "dropped"}


def stored_keys_by_row(out: Path) -> list[str]:
    """The plan key of each speculators row: the planned samples not dropped, with
    finalize's renumbering (hsx_compaction.json: old index -> the hole it moved into)."""
    keys = plan_keys(out)
    kept = [i for i in range(len(keys)) if i not in dropped_indices(out)]
    journal = out / "hsx_compaction.json"
    moved = {new: old for old, new in json.loads(journal.read_text())["moves"]} if journal.exists() else {}
    return [keys[moved.get(p, p)] for p in range(len(kept))]


def check_speculators_corpus(out: Path, requests: dict[str, dict], max_length: int, side: str) -> int:
    """Every planned sample not dropped is a speculators row, equal to the reference; returns rows."""
    row_keys = stored_keys_by_row(out)
    rows = speculators_rows(out)
    assert len(rows) == len(row_keys), f"{len(rows)} rows for {len(row_keys)} stored samples"
    for i, row in enumerate(rows):
        ids = row["input_ids"].tolist()
        assert int(row["loss_mask"].sum()) > 0, f"row {i} has nothing to train on"
        expected_sample(requests[row_keys[i]], ids, row["loss_mask"], max_length, side)
        t = len(ids)
        states = torch.cat([row["hidden_states"].reshape(t, 3, HIDDEN),
                            row["verifier_last_hidden_states"].reshape(t, 1, HIDDEN)], dim=1)
        check_states(ids, states)
    return len(rows)


def check_specforge_corpus(out: Path, requests: dict[str, dict], max_length: int, side: str) -> int:
    keys = plan_keys(out)
    batches = specforge_batches(out)
    kept = [i for i in range(len(keys)) if i not in dropped_indices(out)]
    assert sorted(batches) == kept, f"SpecForge read {sorted(batches)} of {len(kept)} stored samples"
    for i, t in batches.items():
        ids = t["input_ids"][0].tolist()
        n = len(ids)
        mask = t["loss_mask"][0].clone()
        raw = torch.load(out / f"rows/{i // 1000:04d}/data_{i}.ckpt", weights_only=True)
        assert torch.equal(raw["input_ids"], t["input_ids"][0])
        # SpecForge's normalizer never supervises the last position; the file has it
        assert torch.equal(mask[:-1], raw["loss_mask"][:-1]) and mask[-1] == 0
        expected_sample(requests[keys[i]], ids, raw["loss_mask"], max_length, side)
        aux = t["hidden_state"][0].reshape(n, 3, HIDDEN)
        errs = per_layer_rel_err(aux, reference(ids)[:, :3])
        assert max(errs) < FP32_TOL, f"sample {i}: aux relative error per layer {dict(zip(LAYERS, errs))}"
        post = t["target"][0]
        err = per_layer_rel_err(post.unsqueeze(1), postnorm_reference(ids).unsqueeze(1))[0]
        assert err < FP32_TOL, f"sample {i}: post-norm hidden_state relative error {err}"
    return len(batches)
