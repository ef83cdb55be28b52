"""Load an hsx corpus with the trainers' own readers: speculators 0.9 or SpecForge 0.2.

    python docs/examples/load_corpus.py CORPUS_DIR [--max-len 4096] [--show 3]

The corpus's hsx_format.json says which trainer it was written for (`hsx extract --format
speculators | specforge`, a shard or a merged corpus alike). The two functions below are
what each trainer runs on it, called the way its own training entry point calls them, so a
corpus that loads here loads in training; copy the one you need. Prints one line per
sample (its tokens, supervised tokens and tensor shapes) for the first `--show` samples and
a count of all. Tested: tests/client/corpus/test_load_corpus_example.py.

Needs the trainer's package: `pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0`
or `pip install --no-deps specforge==0.2.0`, and the packages their readers import
(scripts/install.sh --test installs both sets); their full dependency sets (a GPU torch,
sglang) are not needed to read a corpus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def speculators_rows(corpus: Path, max_len: int):
    """speculators 0.9's ArrowDataset, as `speculators train --data-path CORPUS --on-missing
    raise` builds it. Each row: input_ids [T], loss_mask [T] (int64 0/1), hidden_states
    [T, 3H] (the three auxiliary layers, ascending) and verifier_last_hidden_states [T, H]
    (the last layer, before the final norm)."""
    from speculators.train.data import ArrowDataset

    facts = json.loads((corpus / "hsx_format.json").read_text())
    if facts.get("states") == "none":  # `hsx extract --states none`: the token table only
        raise SystemExit(f"{corpus} holds no states (--states none): train it with {facts['train_with']}")
    transfer = None
    if facts.get("stored_dtype") == "float8_e4m3fn":  # `hsx extract --dtype fp8`: speculators' fp8 backend
        from hs_connectors import FP8Transfer

        transfer = FP8Transfer(corpus / "hidden_states")
    # train_ratio=1.0: every row (speculators train holds 10% out for validation by default)
    dataset = ArrowDataset(max_len, str(corpus), transfer=transfer, on_missing="raise", train_ratio=1.0)
    for i in range(len(dataset)):
        row = dataset[i]
        if not isinstance(row, dict):  # e.g. a states file whose token ids are not the row's: skipped in training
            raise SystemExit(f"speculators could not use row {i}: {row!r}; run hsx verify on {corpus}")
        yield row


def specforge_batches(corpus: Path, max_len: int, ttt_length: int = 7):
    """SpecForge 0.2's offline EAGLE-3 reader, feature store, normalizer and collator, as its
    launcher builds them (`--hidden-states-path CORPUS`), one sample a batch. Each batch:
    input_ids [1, T], loss_mask [1, T] (its normalizer never supervises the last position),
    hidden_state [1, T, 3H] (the auxiliary layers) and target [1, T, H] (the last layer after
    the final norm). Train with `--vocab-mapping CORPUS/vocab_mapping/vocab_mapping.pt`."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    run_id = "load-corpus"
    provider = builtin_algorithm_registry().resolve("eagle3").providers.offline_for("text")
    refs = provider.build_reader(str(corpus), run_id=run_id, ttt_length=ttt_length, max_len=max_len).read()
    loader = FeatureDataLoader(
        LocalFeatureStore(run_id), refs=refs, batch_size=1, collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(max_len, ttt_length=ttt_length, use_usp_preprocess=False),
        drop_last=False, strategy="eagle3",
    )
    for batch in loader:
        yield batch.sample_ids[0], batch.tensors


def _shapes(tensors: dict) -> str:
    return ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items() if hasattr(v, "shape"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Load an hsx corpus with the trainers' own readers.")
    p.add_argument("corpus", type=Path, help="a corpus directory written by hsx extract (or hsx merge)")
    p.add_argument("--max-len", type=int, default=4096, help="the trainer's sequence length (default 4096)")
    p.add_argument("--show", type=int, default=3, help="samples to describe (default 3)")
    a = p.parse_args(argv)
    facts_file = a.corpus / "hsx_format.json"
    if not facts_file.is_file():
        raise SystemExit(f"{a.corpus} is no finished hsx corpus (no hsx_format.json): run hsx extract or hsx verify on it")
    fmt = json.loads(facts_file.read_text())["format"]
    count = 0
    if fmt == "speculators":
        for i, row in enumerate(speculators_rows(a.corpus, a.max_len)):
            if i < a.show:
                print(f"row {i}: {len(row['input_ids'])} tokens, {int(row['loss_mask'].sum())} supervised; {_shapes(row)}")
            count += 1
    elif fmt == "specforge":
        for i, (sample_id, tensors) in enumerate(specforge_batches(a.corpus, a.max_len)):
            if i < a.show:
                print(f"sample {sample_id}: {tensors['input_ids'].shape[1]} tokens, "
                      f"{int(tensors['loss_mask'].sum())} supervised; {_shapes(tensors)}")
            count += 1
    else:
        raise SystemExit(f"{a.corpus}: format {fmt!r} has no reader here")
    print(f"{fmt}: {count} samples read from {a.corpus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
