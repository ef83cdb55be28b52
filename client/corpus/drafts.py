"""The draft models a corpus can be made for (`hsx extract --draft`): which trainer (corpus
format) trains each one, which layers it reads, and its default layer set.

Layer ids are hsx's (shared/DESIGN.md): id k is the residual stream after k decoder layers,
id N (num_hidden_layers) the last layer's output before the final norm. Where a trainer
numbers layers otherwise, the conversion is said at the entry.

What each trainer reads, from the installed wheels (speculators 0.9.0, specforge 0.2.0):

- speculators, every draft: `hidden_states [T, K+1, H]`; its reader splits the last slice
  off as the verifier's last state and flattens the K others as the aux features
  (speculators/train/data.py). K comes from the draft: EAGLE-3, P-EAGLE, DFlash and DSpark
  take `--target-layer-ids` (hsx numbering: id N is valid, "matching the ids
  scripts/launch_vllm.py emits"), default [2, N//2, N-3] (speculators/models/utils.py,
  resolve_target_layer_ids; used by models/peagle/core.py and models/dflash/core.py, which
  DSpark reuses); MTP uses the last layer only (speculators/models/mtp/core.py,
  target_layer_ids; models/mtp/data.py feeds it verifier_last_hidden_states).
- SpecForge, offline `*.ckpt` records (specforge/algorithms/<name>/providers.py):
  eagle3 `aux_hidden_state` [1, T, 3H] + `hidden_state` (after the final norm);
  dflash and domino `hidden_states` [1, T, K*H], no last state
  (common/dflash_family_data.py, normalize_offline_sample); dspark the same plus
  `target_last_hidden_states` [1, T, H] (normalize_dspark_offline_sample; its provider's
  target representation is "hidden_state", the post-norm state eagle3's record holds).
  P-EAGLE has a streaming contract only (peagle/providers.py): no offline corpus.
  SpecForge's DFlash family numbers a layer j as `output_hidden_states[j + 1]`
  (specforge/modeling/draft/dflash.py, extract_context_feature), i.e. hsx id j + 1; its
  default draft has 1 layer and captures `build_target_layer_ids(N, 1)` = [N // 2]
  (specforge/algorithms/model_providers.py, populate_dflash_generated_config), so hsx
  [N // 2 + 1]; a draft of n layers spreads n ids over 1..N-3 (build_target_layer_ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hsx.layers import default_layers as eagle3_layers

DEFAULT_DRAFT = "eagle3"


def _speculators_aux(n: int) -> list[int]:
    """speculators' default aux ids [2, N//2, N-3] plus N; a collision (small N, which
    speculators itself refuses) resolved as hsx.layers.default_layers does."""
    return eagle3_layers(n)


def specforge_spread(n: int, draft_layers: int) -> list[int]:
    """SpecForge's build_target_layer_ids(N, n) (specforge/modeling/draft/dflash.py) in hsx ids."""
    if draft_layers == 1:
        return [n // 2 + 1]
    start, end = 1, n - 3
    return [int(round(start + i * (end - start) / (draft_layers - 1))) + 1 for i in range(draft_layers)]


@dataclass(frozen=True)
class TrainerUse:
    """How one trainer (corpus format) reads a draft's layers."""

    default: Callable[[int], list[int]]  # N -> the default layer set (hsx ids, ascending)
    min_aux: int  # auxiliary layers (ids below N) it needs at least
    max_aux: int | None  # at most (None: any number)
    last: bool  # the set must end with N (the last layer, pre-norm)
    record: str  # what the corpus file holds, for errors and hsx_format.json
    min_id: int = 0  # the lowest id it can name (SpecForge's DFlash family: its id j is hsx id j + 1, j >= 0)


@dataclass(frozen=True)
class Draft:
    name: str
    title: str
    trainers: dict[str, TrainerUse]  # format name -> use

    def use(self, fmt: str) -> TrainerUse:
        if fmt not in self.trainers:
            raise DraftError(unsupported(self, fmt))
        return self.trainers[fmt]


class DraftError(ValueError):
    """A draft or layer set a run cannot make (one line, naming --draft / --layers)."""


_SPEC_STATES = "hidden_states [T, K+1, H] (K aux + the last, pre-norm)"

DRAFTS: dict[str, Draft] = {d.name: d for d in (
    Draft("eagle3", "EAGLE-3", {
        "speculators": TrainerUse(eagle3_layers, 3, 3, True, _SPEC_STATES),
        "specforge": TrainerUse(eagle3_layers, 3, 3, True,
                                "aux_hidden_state [1, T, 3H], hidden_state [1, T, H] (post-norm)"),
    }),
    Draft("peagle", "P-EAGLE", {
        "speculators": TrainerUse(_speculators_aux, 1, None, True, _SPEC_STATES),
    }),
    Draft("dflash", "DFlash", {
        "speculators": TrainerUse(_speculators_aux, 1, None, True, _SPEC_STATES),
        "specforge": TrainerUse(lambda n: specforge_spread(n, 1), 1, None, False,
                                "hidden_states [1, T, K*H] (K aux layers, no last state)", min_id=1),
    }),
    Draft("dspark", "DSpark", {
        "speculators": TrainerUse(_speculators_aux, 1, None, True, _SPEC_STATES),
        "specforge": TrainerUse(lambda n: [*specforge_spread(n, 1), n], 1, None, True,
                                "hidden_states [1, T, K*H], target_last_hidden_states [1, T, H] (post-norm)", min_id=1),
    }),
    Draft("mtp", "MTP", {
        "speculators": TrainerUse(lambda n: [n], 0, 0, True, _SPEC_STATES + ", K = 0"),
    }),
    Draft("domino", "Domino", {
        "specforge": TrainerUse(lambda n: specforge_spread(n, 1), 1, None, False,
                                "hidden_states [1, T, K*H] (K aux layers, no last state)", min_id=1),
    }),
)}


def get_draft(name: str | None) -> Draft:
    name = name or DEFAULT_DRAFT
    if name not in DRAFTS:
        raise DraftError(f"--draft {name!r} is unknown (choose from {', '.join(DRAFTS)})")
    return DRAFTS[name]


def unsupported(draft: Draft, fmt: str) -> str:
    other = ", ".join(f"--format {f}" for f in draft.trainers)
    return f"--draft {draft.name}: {fmt}'s trainer does not train {draft.title} drafts from a corpus; use {other}"


def default_layers(draft: str | None, fmt: str, n: int) -> list[int]:
    """The layer set `draft` reads under `fmt`'s trainer for a model of `n` decoder layers."""
    return sorted(get_draft(draft).use(fmt).default(n))


def layer_problem(draft_name: str | None, fmt: str, layers: list[int], n: int | None,
                  served: list[int]) -> str | None:
    """Why `layers` cannot make a `draft` corpus for `fmt`, naming --draft / --layers and
    what to pass; None when they can. `n`: num_hidden_layers (None: unknown, only the count
    is checked)."""
    draft = get_draft(draft_name)
    use = draft.use(fmt)
    layers = sorted(layers)
    why = _shape_problem(use, layers, n)
    if why is None:
        return None
    head = f"--draft {draft.name} ({draft.title}, --format {fmt}) reads {use.record}; --layers {_csv(layers)} {why}"
    if n is None:
        return head
    want = default_layers(draft.name, fmt, n)
    if set(want) <= set(served):
        return f"{head}: pass --layers {_csv(want)} (the server serves {_csv(served)})"
    return f"{head}: the server serves {_csv(served)}; restart hsx serve with --layers {_csv(want)}"


def _shape_problem(use: TrainerUse, layers: list[int], n: int | None) -> str | None:
    if len(set(layers)) != len(layers) or not layers:
        return "must be distinct ids"
    if layers[0] < use.min_id:
        return f"must be ids of {use.min_id} or more (the trainer cannot name id {layers[0]})"
    if n is None:
        aux = len(layers) - (1 if use.last else 0)
    else:
        if use.last and layers[-1] != n:
            return f"must end with {n}, the last layer"
        aux = sum(1 for k in layers if k < n)
        if not use.last and n in layers:
            return f"must not hold {n} (this record has no last state; the aux ids are below {n})"
    if aux < use.min_aux or (use.max_aux is not None and aux > use.max_aux):
        need = use.min_aux if use.max_aux == use.min_aux else f"at least {use.min_aux}"
        return f"has {aux} auxiliary layer(s), needs {need}"
    return None


def _csv(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def trainer_layer_ids(draft: str | None, fmt: str, layers: list[int]) -> dict:
    """How to name these layers to the trainer (recorded in hsx_format.json): speculators'
    --target-layer-ids (hsx ids: the aux ones), SpecForge's DFlash family's
    dflash_config.target_layer_ids (its ids: hsx id - 1, module doc)."""
    d = get_draft(draft)
    use = d.use(fmt)
    aux = sorted(layers)[:-1] if use.last else sorted(layers)
    if not aux:
        return {}
    if fmt == "speculators":
        return {"target_layer_ids": aux, "flag": "--target-layer-ids " + " ".join(map(str, aux))}
    if d.name in ("dflash", "dspark", "domino"):
        ids = [k - 1 for k in aux]
        return {"target_layer_ids": ids, "draft_config": {"dflash_config": {"target_layer_ids": ids}}}
    return {}


def layers_help() -> str:
    """Per draft and format, the default layer set (`hsx extract --help`)."""
    rows = []
    for d in DRAFTS.values():
        for fmt in d.trainers:
            rows.append(f"  {d.name:<7} --format {fmt:<12} layers {_symbolic(d.name, fmt)}")
    return "\n".join(rows)


def _symbolic(draft: str, fmt: str) -> str:
    if draft == "mtp":
        return "N (the last only)"
    if fmt == "specforge" and draft in ("dflash", "domino"):
        return "N//2+1 (no last; SpecForge's 1-layer draft)"
    if fmt == "specforge" and draft == "dspark":
        return "N//2+1,N"
    return "2,N//2,N-3,N"
