#!/usr/bin/env python
"""Every draft the trainers train, trained from an hsx corpus by the trainers' own code (issue 39).
`python bench/draft_families.py [--steps 40] [--pairs speculators:dflash,...] --out FILE.json`

For each (trainer, draft) pair of client/corpus/drafts.py, on the tiny fixture model
(shared/fixtures/models/stories260K, N = 5 layers; speculators' MTP takes Qwen3-family
verifiers only: a random Qwen3 of the same shape and tokenizer) on the CPU:
1. the corpus: the model's states at the draft's default layer set (drafts.default_layers),
   computed as the server computes them (id k < N: the residual stream after k layers,
   transformers' output_hidden_states[k]; id N: the last layer before the final norm), for
   OASST chats tokenized with the model's tokenizer; written by hsx's own writers
   (`get_format(format, draft=...)`: encode_sample, finalize), as the run loop does;
2. training: speculators through its `train` entry (`python -m hsx_client.training.speculators_train
   --device cpu --speculator-type DRAFT`, its file backend reading the corpus); SpecForge
   through its algorithm registry (bench/_specforge_train.py, a process with TRITON_INTERPRET=1:
   EAGLE-3's loss is a Triton kernel): the offline provider's reader, normalizer and collator
   over the corpus, the registered draft and training model, its loss; the target is the
   fixture with the `*.index.json` SpecForge's target head loader reads (specforge_target);
3. the loss of each step; the pair passes when the mean of the last quarter is below the
   mean of the first quarter.
Writes {"runs": [{"trainer", "draft", "layers", "loss": [first ... last], "falls"}], ...}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "fixtures"
MODEL = SHARED / "models" / "stories260K"
CHATS = SHARED / "chat" / "oasst" / "threads.messages.jsonl"
LOSS_RE = re.compile(r"train/loss=([0-9.eE+-]+|nan|inf)")
DRAFT_VOCAB = 256
TOTAL_SEQ_LEN = 256  # tokens per packed speculators batch: ~25 steps an epoch of the default 64 rows


def log(msg: str) -> None:
    print(f"[draft_families] {msg}", file=sys.stderr, flush=True)


SKIPPED: set[tuple[str, str]] = set()  # every pair the trainers support is trained
# SpecForge's EAGLE-3 meets its bfloat16 target head with the stored hidden_state as stored
# (bench/_specforge_train.py, DTYPE): its corpus is bfloat16, as hsx serve's default writes it.
CORPUS_DTYPE = {("specforge", "eagle3"): "bfloat16"}


def all_pairs() -> list[tuple[str, str]]:
    from hsx_client.corpus.drafts import DRAFTS

    return [(fmt, d.name) for d in DRAFTS.values() for fmt in d.trainers if (fmt, d.name) not in SKIPPED]


# ----------------------------------------------------------------------------- the corpus


def token_rows(model: Path, samples: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per OASST chat: user turn unsupervised, assistant turn supervised."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows = []
    for line in CHATS.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        if len(msgs) < 2:
            continue
        q = tok(msgs[0]["content"], add_special_tokens=True)["input_ids"]
        a = tok(" " + msgs[1]["content"], add_special_tokens=False)["input_ids"]
        ids, mask = (q + a)[:max_len], ([0] * len(q) + [1] * len(a))[:max_len]
        if sum(mask) >= 8:
            rows.append((ids, mask))
        if len(rows) == samples:
            break
    return rows


def model_states(model: Path, rows: list) -> list:
    """All of a row's layer ids 0..N ([T, N+1, H], id N pre-norm), as hsx serve captures them."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    pre: dict = {}
    m.model.norm.register_forward_hook(lambda mod, inp, out: pre.__setitem__("x", inp[0]))
    out = []
    with torch.no_grad():
        for ids, _ in rows:
            hs = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
            n = len(hs) - 1
            out.append(torch.stack([*hs[:n], pre["x"]], dim=0)[:, 0].transpose(0, 1).contiguous())
    return out


def final_norm(model: Path):
    from safetensors.torch import load_file

    from hsx_client.postnorm import FinalNorm

    cfg = json.loads((model / "config.json").read_text())
    w = load_file(str(model / "model.safetensors"))["model.norm.weight"]  # both verifiers (Llama, Qwen3) are RMSNorm
    return FinalNorm(w.float().numpy(), cfg["rms_norm_eps"], "rms")


def write_corpus(out: Path, fmt_name: str, draft: str, rows: list, states: list, n: int, norm,
                 dtype: str = "float32") -> list[int]:
    """The corpus of one pair through hsx's writers, its states in `dtype`; returns its layers."""
    import torch

    import numpy as np

    from hsx.wire import Decoded
    from hsx_client.corpus import drafts, store
    from hsx_client.corpus.formats import CorpusContext, get_format

    layers = drafts.default_layers(draft, fmt_name, n)
    fmt = get_format(fmt_name, draft=draft)
    ctx = CorpusContext(layer_ids=layers, hidden_size=states[0].shape[-1], dtype=dtype,
                        final_norm=norm if fmt.needs_final_norm else None, draft_vocab_size=DRAFT_VOCAB,
                        vocab_size=512, mask_policy="per_turn")
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for i, ((ids, mask), hs) in enumerate(zip(rows, states)):
        d = Decoded(hidden_states=hs[:, layers].to(getattr(torch, dtype)).contiguous(), token_ids=np.asarray(ids, np.int64),
                    loss_mask=np.asarray(mask, np.uint8), metadata={"layer_ids": json.dumps(layers)})
        if fmt.drop_reason(np.asarray(mask)):
            continue
        so = fmt.encode_sample(len(records), d, ctx)
        store.write_files_atomic(out, so.files)
        records.append((len(records), so.record))
    fmt.finalize(out, records, ctx)
    return layers


# ----------------------------------------------------------------------------- training


def train_speculators(data: Path, draft: str, layers: list[int], n: int, steps: int, work: Path,
                      verifier: Path) -> list[float]:
    aux = [k for k in layers if k < n]
    argv = [sys.executable, "-m", "hsx_client.training.speculators_train", "--device", "cpu",
            "--speculator-type", draft, "--verifier-name-or-path", str(verifier), "--data-path", str(data),
            "--save-path", str(work / f"ckpt-speculators-{draft}"), "--no-resume-from-checkpoint",
            "--on-missing", "raise", "--seed", "0", "--total-seq-len", str(TOTAL_SEQ_LEN), "--num-workers", "0",
            "--epochs", str(epochs_for(data, steps)), "--max-steps", str(steps), "--train-data-ratio", "0.9",
            "--lr", "3e-3",
            "--draft-vocab-size", str(DRAFT_VOCAB), "--logger", "", "--log-freq", "1",
            "--hidden-states-dtype", "float32", "--checkpoint-freq", "1000",
            *(["--target-layer-ids", *map(str, aux)] if aux else [])]
    if draft in ("dflash", "dspark"):
        argv += ["--num-layers", "1", "--block-size", "4"]
    logf = work / f"train-speculators-{draft}.log"
    with open(logf, "wb") as f:
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    text = logf.read_text(errors="replace")
    if r.returncode:
        raise SystemExit(f"speculators {draft} failed ({r.returncode}):\n{text[-3000:]}")
    return [float(x) for x in LOSS_RE.findall(text)][:steps]


def epochs_for(data: Path, steps: int) -> int:
    """Epochs enough for `steps` packed batches and no more: speculators' --max-steps ends only
    the epoch it is reached in, every later epoch still runs a step and a validation pass
    (bench/draft_quality.py, epochs_for)."""
    from datasets import load_from_disk

    tokens = sum(load_from_disk(str(data)).with_format(None)["seq_len"]) * 0.9
    return max(1, -(-steps // max(1, int(tokens // TOTAL_SEQ_LEN))))


def train_pair(fmt: str, draft: str, data: Path, layers: list[int], n: int, steps: int, work: Path,
               verifier: Path) -> list[float]:
    if fmt == "speculators":
        return train_speculators(data, draft, layers, n, steps, work, verifier)
    return train_specforge(data, draft, specforge_target(verifier, work), steps, work)


def train_specforge(data: Path, draft: str, target: Path, steps: int, work: Path) -> list[float]:
    """bench/_specforge_train.py in a process of its own: TRITON_INTERPRET=1 must be set before
    Triton compiles SpecForge's EAGLE-3 loss kernel (at import), and the CPU has no Triton backend."""
    import os

    argv = [sys.executable, str(Path(__file__).resolve().parent / "_specforge_train.py"), "--data", str(data),
            "--draft", draft, "--model", str(target), "--steps", str(steps)]
    logf = work / f"train-specforge-{draft}.log"
    with open(logf, "wb") as f:
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                           env={**os.environ, "TRITON_INTERPRET": "1"})
    text = logf.read_text(errors="replace")
    found = re.findall(r"^LOSSES (\[.*\])$", text, re.M)
    if r.returncode or not found:
        raise SystemExit(f"specforge {draft} failed ({r.returncode}):\n{text[-3000:]}")
    BATCHES[draft] = int(re.findall(r"^BATCHES (\d+)$", text, re.M)[-1])
    return json.loads(found[-1])


BATCHES: dict[str, int] = {}  # SpecForge pairs: the batches its steps cycle through (one sample each)


def specforge_target(model: Path, work: Path) -> Path:
    """The target as SpecForge's frozen target head loads it: its TargetHead.load_weights finds
    the lm_head's file through a `*.index.json` weight map, which a one-file checkpoint such as
    the fixture's lacks (specforge/modeling/target/target_head.py). A copy of links to the
    model's files plus that index (every tensor in model.safetensors)."""
    from safetensors import safe_open

    out = work / f"{model.name}-indexed"
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# speculators' MTP supports Qwen3-family verifiers only (speculators/models/mtp: "Unsupported MTP
# model type 'llama'"): its pair uses a random Qwen3 of the fixture's shape and tokenizer.
QWEN3_DRAFTS = ("mtp",)


def tiny_qwen3(work: Path) -> Path:
    """A random Qwen3 with stories260K's shape, vocab and tokenizer (seed 0)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = work / "tiny-qwen3"
    if (out / "model.safetensors").exists():
        return out
    src = json.loads((MODEL / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
            "eos_token_id", "tie_word_embeddings")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**{k: src[k] for k in keep}))
    model.save_pretrained(str(out))
    # speculators' MTP starts from the verifier's native MTP head (speculators/convert/mtp/converter.py
    # refuses a checkpoint without `mtp.*` keys): a random one, the rest of the head is its init.
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "model.safetensors"))
    h = src["hidden_size"]
    weights.update({"mtp.fc.weight": torch.randn(h, 2 * h) * 0.02, "mtp.norm.weight": torch.ones(h)})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in MODEL.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def verifier_for(draft: str, work: Path) -> Path:
    return tiny_qwen3(work) if draft in QWEN3_DRAFTS else MODEL


def falls(loss: list[float], cycle: int | None = None) -> bool:
    """The last quarter's mean below the first's; where the steps cycle through `cycle` batches
    of one sample each (SpecForge's loop) and visit each twice or more, each batch's first
    visit against its last (the first `cycle` steps against the last `cycle`), so that
    samples of other difficulty do not decide it."""
    if cycle and len(loss) >= 2 * cycle:
        return sum(loss[-cycle:]) < sum(loss[:cycle])
    q = max(1, len(loss) // 4)
    return len(loss) >= 4 and sum(loss[-q:]) / q < sum(loss[:q]) / q


def run(pairs: list[tuple[str, str]], steps: int, samples: int, work: Path) -> list[dict]:
    rows = token_rows(MODEL, samples, max_len=128)
    targets: dict[Path, tuple] = {}  # verifier -> (its states of the rows, N, final norm)
    runs = []
    for fmt, draft in pairs:
        t0 = time.perf_counter()
        verifier = verifier_for(draft, work)
        if verifier not in targets:
            states = model_states(verifier, rows)
            targets[verifier] = (states, states[0].shape[1] - 1, final_norm(verifier))
        states, n, norm = targets[verifier]
        data = work / f"corpus-{fmt}-{draft}"
        layers = write_corpus(data, fmt, draft, rows, states, n, norm, CORPUS_DTYPE.get((fmt, draft), "float32"))
        loss = train_pair(fmt, draft, data, layers, n, steps, work, verifier)
        runs.append({"trainer": fmt, "draft": draft, "layers": layers, "loss": loss, "falls": falls(loss, BATCHES.get(draft) if fmt == "specforge" else None),
                     "steps": len(loss), **({"cycle": BATCHES[draft]} if fmt == "specforge" else {}), "seconds": round(time.perf_counter() - t0, 1), "verifier": verifier.name})
        log(f"{fmt} {draft} layers {layers}: loss {loss[:1]} ... {loss[-1:]} ({runs[-1]['seconds']} s)")
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--pairs", help="trainer:draft,... (default: every pair the trainers support)")
    p.add_argument("--workdir", default="/tmp/hsx-draft-families")
    p.add_argument("--out")
    a = p.parse_args(argv)
    pairs = [tuple(x.split(":")) for x in a.pairs.split(",")] if a.pairs else all_pairs()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    runs = run(pairs, a.steps, a.samples, work)
    report = {"model": "stories260K (N=5, H=64, vocab 512, fp32)", "device": "cpu", "steps": a.steps,
              "samples": a.samples, "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    bad = [f"{r['trainer']}:{r['draft']}" for r in runs if not r["falls"]]
    if bad:
        log(f"loss did not fall: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
