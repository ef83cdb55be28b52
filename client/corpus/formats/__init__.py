"""Corpus format writers: one decoded response -> the files a trainer reads.

Two formats (see shared/DESIGN.md, "Corpus formats"):

speculators 0.9 (`speculators train --data-path DIR --on-missing raise`)
    hidden_states/hs_{i}.safetensors  {"hidden_states": [T, 4, H] model dtype (ascending
                                      layer ids, last slice pre-norm), "token_ids": int64 [T]}
    data-*.arrow, dataset_info.json, state.json  the `datasets` table (`save_to_disk` after
                                      `set_format("torch")`): input_ids int64, loss_mask int64 0/1,
                                      seq_len; row i <-> hs_i (speculators' reader is positional
                                      and drops a row whose token_ids differ from input_ids)
    token_freq.pt, d2t-{K}.npy, t2d-{K}.npy    vocab mapping (client/corpus/vocab.py)
    hsx_format.json                   format facts (mask policy, counts, compaction)

    Variants (`hsx extract --states none` / `--dtype fp8`, picked by `format_options` of a
    run's settings): speculators_variants.py.

SpecForge 0.2 (offline; `--hidden-states-path DIR --vocab-mapping DIR/vocab_mapping/vocab_mapping.pt`)
    rows/{i // 1000:04d}/data_{i}.ckpt  torch.save {"input_ids": int64 [T], "loss_mask": int64 [T],
                                      "aux_hidden_state": [1, T, 3H] (three aux layers concatenated
                                      ascending), "hidden_state": [1, T, H] (last layer after the
                                      final norm)}; 1000 files per directory
    vocab_mapping/vocab_mapping.pt    {"d2t": int64 [K], "t2d": bool [V]}
    hsx_format.json

Both readers walk or index the corpus directory themselves: the store's temporary names
must not end in `.ckpt` (SpecForge lists every `*.ckpt` under the directory) and must not be
`hs_{n}.safetensors`.

The sample record (kept in the manifest, given back to `finalize` / `verify_sample`):
    num_tokens, num_supervised, mask_runs (loss mask as run lengths, starting with a run of
    0s that may be empty), ids_crc32 (zlib.crc32 of the int64 token ids), hidden_size,
    num_layers, dtype, mask_source ("server" or "none": no mask came back, every token
    supervised).
"""

from __future__ import annotations

from hsx_client.corpus.formats.common import (
    COMPACTION_JOURNAL, FORMAT_FILE, CorpusContext, CorpusFormat, CorpusFormatError, FormatDefaults, SampleOutput,
    mask_to_runs, runs_to_mask,
)
from hsx_client.corpus.formats.specforge import SpecForgeFormat
from hsx_client.corpus.formats.speculators import SpeculatorsFormat
from hsx_client.corpus.settings import SETTING_DEFAULTS, CorpusSettings

_FORMATS = {"speculators": SpeculatorsFormat, "specforge": SpecForgeFormat}


# The run settings that pick a variant, and their defaults.
FORMAT_OPTIONS = {k: SETTING_DEFAULTS[k] for k in ("states", "dtype")}
DRAFT_OPTION = "draft"  # the draft a writer writes for (client/corpus/drafts.py)


def format_options(settings: CorpusSettings) -> dict[str, str]:
    """The variant settings of a run (a plan's, a corpus's) that differ from the defaults
    (none: the plain format)."""
    opts = {k: getattr(settings, k) for k, d in FORMAT_OPTIONS.items() if getattr(settings, k) != d}
    if settings.draft != SETTING_DEFAULTS[DRAFT_OPTION]:
        opts[DRAFT_OPTION] = settings.draft
    return opts


def get_format(name: str, draft: str | None = None, **options: str) -> CorpusFormat:
    """The writer for "speculators" or "specforge", for `draft` (default eagle3; a draft the
    format's trainer does not train: ValueError, one line); `states="none"` / `dtype="fp8"`
    pick speculators' token-table and fp8 variants (speculators_variants.py)."""
    from hsx_client.corpus import drafts

    if name not in _FORMATS:
        raise ValueError(f"unknown corpus format {name!r} (choose from {sorted(_FORMATS)})")
    use = drafts.get_draft(draft).use(name)  # DraftError (a ValueError) when the trainer lacks it
    if any(options.get(k, d) != d for k, d in FORMAT_OPTIONS.items()):
        from hsx_client.corpus.formats.speculators_variants import variant_format

        fmt = variant_format(name, **{**FORMAT_OPTIONS, **options})
    else:
        fmt = _FORMATS[name]()
    fmt.draft = drafts.get_draft(draft).name
    fmt.needs_final_norm = fmt.needs_final_norm and use.last  # no last state in the record: no norm
    return fmt


__all__ = [
    "COMPACTION_JOURNAL", "FORMAT_FILE", "CorpusContext", "CorpusFormat", "CorpusFormatError", "FormatDefaults", "SampleOutput",
    "SpecForgeFormat", "SpeculatorsFormat", "FORMAT_OPTIONS", "format_options", "get_format", "mask_to_runs", "runs_to_mask",
]
