#!/usr/bin/env python
"""Does hsx's data train drafts as good as the reference pipeline's? (issue 30)
`python bench/draft_quality.py [flags] --out FILE.json [--plot FILE.png]`

For one target and one chat set, with fixed seeds, the same EAGLE-3 draft is trained with
speculators' own trainer (`python -m hsx_client.training.speculators_train`) for K steps on:
  offline     hsx's corpus (`hsx extract --format speculators`), speculators' file backend;
  online      hsx's token table (`--states none`) with the `hsx` backend (states fetched
              from `hsx serve` while training, none on disk);
  reference   the same token table with states from vLLM's own `extract_hidden_states` and
              its file connector, read as speculators' `generate-offline-data` reads them
              (bench/draft_engines.py reference);
  regenerated (with --regenerate, or --regenerated FILE) hsx's corpus of the target's own
              responses: the training chats with every assistant turn written again by the
              target (`hsx regenerate` against the same `hsx serve`, greedy; or FILE, its
              output made beforehand).
Each draft is then served with the target through vLLM's EAGLE-3 speculative decoding,
greedy, on held-out prompts (the first user turn of the chats after the training ones);
the report holds mean acceptance length, acceptance rate per draft position and the loss
curves of every run and seed, side by side, as JSON and a PNG plot.

Defaults: the shared stories260K (fp32, layers 1,2,4,5: the draft reads 1,2,4, the last is
the verifier's) with the shared llama3 template and OASST threads; `--device cpu` trains on
the CPU (hsx_client.training.speculators_train's CPU route). Intermediate corpora stay in --workdir
and are reused by a rerun with the same flags (delete it for a fresh run).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# the report's half, beside this script (its directory is on sys.path when it runs)
from draft_quality_report import compare_states, plot, summarize

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "fixtures"
ENGINES = Path(__file__).resolve().parent / "draft_engines.py"
TRAIN_RATIO = 0.95  # of the corpus's rows; the rest is speculators' validation split
RUNS = ("offline", "online", "reference", "regenerated")
METRIC_RE = re.compile(r"train/(loss(?:_\d+)?|full_acc_\d+|cond_acc_\d+)=([0-9.eE+-]+|nan|inf)")


def log(msg: str) -> None:
    print(f"[draft_quality] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- inputs


def split_chats(path: Path, train: int, heldout: int) -> tuple[list[str], list[list[dict]]]:
    """The first `train` chats (JSONL lines, as given) for training; the first user turn of
    the `heldout` chats after them, as the held-out prompts."""
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    if len(lines) < train + heldout:
        raise SystemExit(f"{path}: {len(lines)} chats, fewer than --train-chats {train} + --heldout {heldout}")
    prompts = []
    for line in lines[train:train + heldout]:
        msgs = json.loads(line)["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        prompts.append(msgs[:first_user + 1])
    return lines[:train], prompts


def prompt_ids(model: Path, template: Path, chats: list[list[dict]], max_len: int) -> list[list[int]]:
    """The held-out prompts as the target's chat template renders them (generation prompt on)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    out = []
    for msgs in chats:
        text = tok.apply_chat_template(msgs, chat_template=template.read_text(), add_generation_prompt=True,
                                       tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"][-max_len:])
    return out


# ----------------------------------------------------------------------------- steps


class Timings(dict):
    """Seconds per step, kept in the workdir as they come: a rerun that continues a run cut
    short (the next device call) reports the first call's steps too."""

    def __init__(self, path: Path):
        super().__init__(json.loads(path.read_text()) if path.exists() else {})
        self.path = path

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, round(value, 2))
        self.path.write_text(json.dumps(self, indent=1))


def run_logged(cmd: list[str], log_path: Path, env: dict | None = None, timeout: float | None = None) -> str:
    with open(log_path, "wb") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    text = log_path.read_text(errors="replace")
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{text[-4000:]}")
    return text


def loss_curve(train_log: str) -> list[dict[str, float]]:
    """One dict per logged step of speculators' `train/` figures (`loss_k`, `full_acc_k`,
    `cond_acc_k`: k is the TTT step; `loss`: their sum). Its console wraps long lines, so the
    log is read as one stream of `key=value`, a new step at each `loss_0`."""
    steps: list[dict[str, float]] = []
    for key, value in METRIC_RE.findall(train_log):
        if key == "loss_0" or not steps:
            steps.append({})
        steps[-1][key] = float(value)
    return steps


def last_checkpoint(save: Path) -> Path:
    """speculators saves one numbered directory per epoch (weights only in the ones it
    keeps); the highest is the trained draft."""
    dirs = [d for d in save.iterdir() if d.is_dir() and d.name.isdigit() and (d / "model.safetensors").exists()]
    if not dirs:
        raise SystemExit(f"{save}: no checkpoint with its weights (model.safetensors)")
    return max(dirs, key=lambda d: int(d.name))


def epochs_for(table: Path, steps: int, total_seq_len: int, train_ratio: float) -> int:
    """Epochs enough for `steps` packed batches, and no more: speculators' --max-steps only
    ends the epoch it is reached in, and every later epoch still runs one step (and a
    validation pass and a checkpoint). A packed epoch has at least tokens / total_seq_len
    batches, so this bound can only fall short of --steps by nothing and overshoot by little."""
    from datasets import load_from_disk

    tokens = sum(load_from_disk(str(table)).with_format(None)["seq_len"]) * train_ratio
    return max(1, -(-steps // max(1, int(tokens // total_seq_len))))


def train_argv(a, data: Path, save: Path, seed: int, backend: list[str]) -> list[str]:
    layers = [int(x) for x in a.layers.split(",")]
    return ["--verifier-name-or-path", str(a.model), "--data-path", str(data), "--save-path", str(save),
            "--no-resume-from-checkpoint", *backend, "--on-missing", "raise", "--seed", str(seed),
            "--total-seq-len", str(a.total_seq_len), "--num-workers", str(a.num_workers),
            "--epochs", str(a.epochs or epochs_for(data, a.steps, a.total_seq_len, TRAIN_RATIO)),
            "--max-steps", str(a.steps), "--train-data-ratio", str(TRAIN_RATIO),
            "--draft-vocab-size", str(a.draft_vocab_size), "--target-layer-ids", *map(str, layers[:-1]),
            "--logger", "", "--log-freq", "1", "--hidden-states-dtype", a.dtype, *a.train_arg]


def engine_child(what: str, cfg: dict, work: Path, env: dict, timeout: float, timings: dict) -> dict:
    """bench/draft_engines.py WHAT in a child process; its result is kept, so a rerun with
    the same flags skips it. Its seconds (engine start included) go into `timings`."""
    cfg_path = work / f"{what}-{cfg['tag']}.json"
    cfg["result"] = str(work / f"{what}-{cfg['tag']}-result.json")
    if Path(cfg["result"]).exists() and cfg_path.exists() and json.loads(cfg_path.read_text()) == cfg:
        return json.loads(Path(cfg["result"]).read_text())
    cfg_path.write_text(json.dumps(cfg))
    Path(cfg["result"]).unlink(missing_ok=True)
    t = time.monotonic()
    run_logged([sys.executable, str(ENGINES), what, str(cfg_path)], work / f"{what}-{cfg['tag']}.log", env, timeout)
    timings[f"{what}_{cfg['tag']}_s"] = time.monotonic() - t
    return json.loads(Path(cfg["result"]).read_text())


# ----------------------------------------------------------------------------- the driver


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=SHARED / "models" / "stories260K", help="the target")
    p.add_argument("--chats", type=Path, default=SHARED / "chat" / "oasst" / "threads.messages.jsonl")
    p.add_argument("--template", type=Path, default=SHARED / "chat_templates" / "llama3.jinja")
    p.add_argument("--regenerated", type=Path, help="issue 28's regenerated chats (the same chats in the same "
                                                     "order, the target's responses): adds the `regenerated` run, "
                                                     "trained on its first --train-chats lines")
    p.add_argument("--regenerate", action="store_true",
                   help="adds the `regenerated` run on chats made here: `hsx regenerate` of the training chats "
                        "against the same hsx serve (greedy, seed 0) before extracting")
    p.add_argument("--regen-max-tokens", type=int, default=128, help="hsx regenerate --max-tokens (per turn)")
    p.add_argument("--runs", default="offline,online,reference", help=f"which of {','.join(RUNS)}")
    p.add_argument("--layers", default="1,2,4,5", help="served layer ids; the last is the verifier's")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--train-chats", type=int, default=400)
    p.add_argument("--heldout", type=int, default=32, help="held-out prompts for acceptance")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per held-out prompt")
    p.add_argument("--max-length", type=int, default=256, help="hsx extract --max-length")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per training (K)")
    p.add_argument("--epochs", type=int, help="default: enough for --steps (see epochs_for)")
    p.add_argument("--seeds", default="0,1", help="one training per run and seed")
    p.add_argument("--total-seq-len", type=int, default=2048)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--draft-vocab-size", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--server", help="an `hsx serve` of the target already up (its --layers and template): "
                                    "used instead of starting one")
    p.add_argument("--no-acceptance", action="store_true", help="the training half only (no vLLM engines)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: train on the CPU")
    p.add_argument("--engine-arg", action="append", default=[], help="extra vLLM flag for every engine")
    p.add_argument("--server-arg", action="append", default=[], help="extra hsx serve flag")
    p.add_argument("--train-arg", action="append", default=[], help="extra speculators train flag")
    p.add_argument("--label", default="", help="what this run is (goes into the JSON and the plot)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hsx-draft-quality"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plot", type=Path, help="PNG (default: --out with .png)")
    a = p.parse_args(argv)
    a.runs = [r for r in a.runs.split(",") if r]
    if a.regenerated and a.regenerate:
        p.error("--regenerate makes the regenerated chats; --regenerated FILE reads them: one or the other")
    if (a.regenerated or a.regenerate) and "regenerated" not in a.runs:
        a.runs.append("regenerated")
    bad = set(a.runs) - set(RUNS)
    if bad or ("regenerated" in a.runs and not (a.regenerated or a.regenerate)):
        p.error(f"--runs: {sorted(bad) or 'regenerated needs --regenerate or --regenerated FILE'}")
    a.seeds = [int(s) for s in a.seeds.split(",")]
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from hsx_tools.bench.common import child_env, ensure_packages

    work = a.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ensure_packages(work)
    env = child_env()
    t_start = time.monotonic()
    train_lines, heldout = split_chats(a.chats, a.train_chats, a.heldout)
    chats = work / "train-chats.jsonl"
    chats.write_text("\n".join(train_lines) + "\n")
    max_len = json.loads((a.model / "config.json").read_text()).get("max_position_embeddings", 4096)
    prompts = [] if a.no_acceptance else prompt_ids(a.model, a.template, heldout,
                                                    max_len - a.max_tokens - a.num_speculative_tokens - 1)
    engine_flags = ["--dtype", a.dtype, *a.engine_arg]
    corpus = {"offline": work / "corpus-offline", "online": work / "corpus-tokens",
              "reference": work / "corpus-reference", "regenerated": work / "corpus-regenerated"}
    timings = Timings(work / "timings.json")
    report = report_head(a, prompts)
    trained: dict[str, dict[int, dict]] = {}
    hsx_corpora_and_online_run(a, work, env, chats, corpus, engine_flags, timings, trained)
    if "reference" in a.runs and not (corpus["reference"] / "hidden_states").is_dir():
        reference_corpus(a, work, env, corpus, engine_flags, timings)
    if "offline" in a.runs and "reference" in a.runs:
        report["states_offline_vs_reference"] = compare_states(corpus["offline"], corpus["reference"])
    for name in a.runs:
        if name != "online":
            train_runs(a, name, [], work, corpus, env, timings, trained)
    if a.no_acceptance:
        trained = {n: {s: {**r, "acceptance": {}} for s, r in seeds.items()} for n, seeds in trained.items()}
    else:
        measure_acceptance(a, work, env, prompts, engine_flags, timings, trained)
    return finish(a, report, trained, timings, t_start)


def report_head(a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """What the report says of the run before any figure: the inputs, flags and machine."""
    from hsx_tools.bench.common import hardware, versions_light

    return {
        "label": a.label or "hsx draft quality", "model": str(a.model), "chats": str(a.chats),
        "regenerated": str(a.regenerated) if a.regenerated else (
            f"hsx regenerate here: greedy, --max-tokens {a.regen_max_tokens}" if a.regenerate else None),
        "train_chats": a.train_chats,
        "heldout_prompts": len(prompts), "max_tokens": a.max_tokens, "layers": a.layers, "dtype": a.dtype,
        "steps": a.steps, "seeds": a.seeds, "total_seq_len": a.total_seq_len,
        "draft_vocab_size": a.draft_vocab_size, "num_speculative_tokens": a.num_speculative_tokens,
        "device": a.device, "hardware": hardware(),
        "versions": {**versions_light(), **{d: _version(d) for d in ("speculators", "hs-connectors", "transformers")}},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": {},
    }


def train_runs(a: argparse.Namespace, name: str, backend: list[str], work: Path, corpus: dict[str, Path],
               env: dict, timings: dict, trained: dict[str, dict[int, dict]]) -> None:
    """The draft trained on run `name`'s data once per seed (a rerun skips what is done)."""
    for seed in a.seeds:
        done = work / f"train-{name}-s{seed}.json"  # a rerun (the next device call) skips what is done
        if not done.exists():
            log(f"training {name} (seed {seed}, {a.steps} steps) ...")
            save = work / f"ckpt-{name}-s{seed}"
            shutil.rmtree(save, ignore_errors=True)
            t = time.monotonic()
            device = ["--device", "cpu"] if a.device == "cpu" else []
            text = run_logged([sys.executable, "-m", "hsx_client.training.speculators_train", *device,
                               *train_argv(a, corpus[name], save, seed, backend)],
                              work / f"train-{name}-s{seed}.log", env)
            curve = loss_curve(text)
            if (save / "interrupted").exists() or len(curve) < a.steps:  # a SIGTERM'd trainer exits 0
                raise SystemExit(f"training {name} seed {seed} stopped after {len(curve)} of {a.steps} steps "
                                 f"(interrupted?): see {work / f'train-{name}-s{seed}.log'}")
            timings[f"train_{name}_s{seed}_s"] = time.monotonic() - t
            done.write_text(json.dumps({"steps_done": len(curve), "loss_curve": curve,
                                        "train_s": time.monotonic() - t, "draft": str(last_checkpoint(save))}))
        trained.setdefault(name, {})[seed] = json.loads(done.read_text())


def hsx_corpora_and_online_run(a: argparse.Namespace, work: Path, env: dict, chats: Path, corpus: dict[str, Path],
                               engine_flags: list[str], timings: dict, trained: dict[str, dict[int, dict]]) -> None:
    """What needs `hsx serve`: the corpora hsx extracts (and regenerates), and the online
    run's training, which fetches its states while it trains."""
    from hsx_tools.server_process import ServerProcess

    wanted = [(n, chats, x) for n, x in (("offline", []), ("online", ["--states", "none"]))
              if n in a.runs or (n == "online" and "reference" in a.runs)]
    regen = work / "train-regenerated.jsonl"
    if a.regenerated:  # its first --train-chats lines: the held-out chats stay out of training
        regen_lines, _ = split_chats(a.regenerated, a.train_chats, 0)
        regen.write_text("\n".join(regen_lines) + "\n")
    if "regenerated" in a.runs:
        wanted.append(("regenerated", regen, []))
    wanted = [w for w in wanted if not (corpus[w[0]] / "hsx_corpus.json").exists()]  # a rerun keeps corpora
    online_done = all((work / f"train-online-s{seed}.json").exists() for seed in a.seeds)
    need_server = bool(wanted) or ("online" in a.runs and not online_done)
    server = None
    if need_server and not a.server:
        server = ServerProcess(str(a.model), "--layers", a.layers, "--chat-template", str(a.template), *engine_flags,
                               *a.server_arg, log_path=work / "serve.log", env=env)
    url = a.server or (server.url if server else None)
    try:
        if server:
            t = time.monotonic()
            server.wait_ready(1800)
            timings["serve_start_s"] = time.monotonic() - t
        extract = [sys.executable, "-m", "hsx_tools.cli", "extract", "--server", url, "--quiet", "--format",
                   "speculators", "--max-length", str(a.max_length), "--truncation", "left",
                   "--draft-vocab-size", str(a.draft_vocab_size)]
        if a.regenerate and any(w[0] == "regenerated" for w in wanted) and not regen.exists():
            log("hsx regenerate: the training chats' assistant turns by the target ...")
            t = time.monotonic()
            made = work / "regenerated.jsonl"  # hsx regenerate resumes its own journal after a kill
            run_logged([sys.executable, "-m", "hsx_tools.cli", "regenerate", "--server", url, "--quiet", "--json",
                        "--input", str(chats), "--output", str(made), "--max-tokens", str(a.regen_max_tokens),
                        "--seed", "0"], work / "regenerate.log", env)
            made.rename(regen)  # in place only once complete: a rerun extracts it, or regenerates
            timings["regenerate_s"] = time.monotonic() - t
        for name, src, extra in wanted:  # the token table is also the reference's
            log(f"hsx extract: {corpus[name].name} ...")
            t = time.monotonic()
            run_logged([*extract, "--input", str(src), "--output", str(corpus[name]), *extra],
                       work / f"extract-{name}.log", env)
            timings[f"extract_{name}_s"] = time.monotonic() - t
        if "online" in a.runs:
            train_runs(a, "online", ["--hidden-states-backend", "hsx", "--hsx-servers", url], work, corpus, env,
                       timings, trained)
    finally:
        if server:
            server.stop()


def reference_corpus(a: argparse.Namespace, work: Path, env: dict, corpus: dict[str, Path],
                     engine_flags: list[str], timings: dict) -> None:
    """The reference's corpus: hsx's token table with vLLM's own states (extract_hidden_states)."""
    log("the reference corpus: vLLM's extract_hidden_states + file connector ...")
    tmp = corpus["reference"].with_name("corpus-reference.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(corpus["online"], tmp, ignore=shutil.ignore_patterns("hsx_*.json"))
    engine_child("reference", {"tag": "corpus", "model": str(a.model), "engine_flags": engine_flags,
                               "layers": [int(x) for x in a.layers.split(",")], "table": str(tmp),
                               "out": str(tmp)}, work, env, 3600, timings)
    tmp.rename(corpus["reference"])


def measure_acceptance(a: argparse.Namespace, work: Path, env: dict, prompts: list[list[int]],
                       engine_flags: list[str], timings: dict, trained: dict[str, dict[int, dict]]) -> None:
    """Each draft served with the target (EAGLE-3, greedy) on the held-out prompts."""
    log(f"acceptance: {len(prompts)} held-out prompts x {a.max_tokens} tokens, "
        f"{a.num_speculative_tokens} speculative tokens ...")
    base = {"model": str(a.model), "engine_flags": engine_flags, "prompts": prompts, "max_tokens": a.max_tokens,
            "num_speculative_tokens": a.num_speculative_tokens}
    plain = engine_child("accept", {**base, "tag": "no-draft"}, work, env, 1800, timings)["outputs"]
    for name in a.runs:
        for seed, r in trained[name].items():
            got = engine_child("accept", {**base, "tag": f"{name}-s{seed}", "draft": r["draft"], "seed": seed},
                               work, env, 1800, timings)
            # greedy: speculative decoding must not change the target's tokens
            got["same_tokens_as_without_draft"] = got.pop("outputs") == plain
            r["acceptance"] = got
            log(f"{name} seed {seed}: mean acceptance length {got['mean_acceptance_length']}")


def finish(a: argparse.Namespace, report: dict, trained: dict[str, dict[int, dict]], timings: dict,
           t_start: float) -> int:
    report["runs"] = {name: {str(s): r for s, r in trained[name].items()} for name in a.runs}
    report["summary"] = summarize(trained)
    report["timings"] = {**timings, "this_call_s": time.monotonic() - t_start}  # the steps: every call's
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    why = plot(report, a.plot or a.out.with_suffix(".png"))
    if why:
        log(why)
    for name, s in report["summary"].items():
        print(f"{name:12s} mean acceptance length {s['mean_acceptance_length']}  (seed spread {s['seed_spread']})  "
              f"per position {[round(x, 3) for x in s['acceptance_rate_per_position']]}  final loss_0 {s['final_loss_0']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
