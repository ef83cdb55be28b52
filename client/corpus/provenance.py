"""The end of a run: the format's finalize, then `hsx_corpus.json`, how the corpus was made.

`finalize` gets only the done samples, `(index, record)` sorted by index; a failed index
is simply absent, and what the format does with the gap (compact the indices or keep
them) is its business (see hsx_client.corpus.formats). `hsx_corpus.json` is written last,
atomically, so its presence marks a finished corpus: the model, layers, chat template,
max length, versions, counts, the failed indices and checksums of finalize's files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hsx import __version__ as hsx_version

from hsx_client.corpus import store
from hsx_client.corpus.plan import split_dropped
from hsx_client.corpus.settings import CorpusSettings


def files_digest(out: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    res = {}
    for rel in rels:
        size, digest = store.hash_file(Path(out) / rel)
        res[rel] = {"size": size, store.HASH_ALGO: digest}
    return res


def finalize(out: Path, fmt: Any, ctx: Any, plan: dict[str, Any], done: dict[int, dict[str, Any]],
             failed: dict[int, dict[str, Any]], info: dict[str, Any], final_norm: Any,
             settings: CorpusSettings) -> dict[str, Any]:
    """Run the format's finalize and write hsx_corpus.json; returns its content."""
    records = sorted((i, e["record"]) for i, e in done.items())
    failures, dropped = split_dropped(failed)
    written = list(fmt.finalize(out, records, ctx) or [])
    for rel in written:
        store.fsync_dir((out / rel).parent)
    corpus = {
        "hsx_corpus_version": 1,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "format": settings.format,
        "states": settings.states,
        "states_dtype": settings.dtype,
        "model": info.get("model"),
        "model_revision": info.get("model_revision"),
        "layer_ids": settings.layers,
        "last_layer_pre_norm": True,
        "num_hidden_layers": info.get("num_hidden_layers"),
        "hidden_size": info.get("hidden_size"),
        "dtype": info.get("dtype"),
        "vocab_size": info.get("vocab_size"),
        "max_model_len": info.get("max_model_len"),
        "chat_template_sha256": info.get("chat_template_sha256"),
        "final_norm": {"eps": getattr(final_norm, "eps", None), "style": getattr(final_norm, "style", None)},
        "max_length": settings.max_length,
        "truncation": settings.truncation if settings.max_length else None,
        "mask_policy": settings.mask_policy,
        "draft_vocab_size": settings.draft_vocab_size,
        "seed": settings.seed,
        "shuffle": settings.shuffle,
        "max_samples": settings.max_samples,
        "inputs": plan.get("inputs"),
        "inputs_sha256": plan.get("inputs_sha256"),
        "shard": plan.get("shard"),
        "versions": {
            "vllm": info.get("vllm_version"),
            "hsx_server": info.get("hsx_version"),
            "hsx_client": hsx_version,
        },
        "counts": {
            "planned": len(plan["keys"]),
            "done": len(done),
            "failed": len(failures),
            "dropped": len(dropped),  # no supervised token after truncation: not a failure
            "truncated": sum(1 for e in done.values() if e.get("truncated_from")),
            "bad_rows": plan.get("bad_rows", 0),
            "input_samples": plan.get("num_input_samples"),
            "tokens": sum(int(e.get("tokens", 0)) for e in done.values()),
        },
        "failed_indices": sorted(failures),
        "dropped_indices": sorted(dropped),
        "finalize_files": files_digest(out, written),
    }
    store.write_json_atomic(out / store.CORPUS_NAME, corpus)
    return corpus
