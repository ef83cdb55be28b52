"""Per-conversation mixes of sampling settings (`hsx regenerate --mix`), as speculators'
`regenerate-responses` offers reasoning-effort and temperature distributions.

A mix is a list of weighted variants, given as JSON or YAML (inline or a file):

    - {name: think,   weight: 3, chat_template_kwargs: {enable_thinking: true}, temperature: 0.6}
    - {name: nothink, weight: 1, chat_template_kwargs: {enable_thinking: false}}

Each conversation gets one variant, drawn from a hash of the run's seed and the
conversation's key (never from a sequential random stream), so a resumed run, a rerun
and every shard assign the same variant to the same conversation. A variant's settings
override the command line's for that conversation; its `chat_template_kwargs` are merged
over --chat-template-kwargs, and `reasoning_effort` is sent as the template switch of
that name (how reasoning templates read it, on hsx serve and vllm serve alike).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# What a variant may set: the per-request sampling knobs `hsx regenerate` sends.
VARIANT_KEYS = ("name", "weight", "temperature", "top_p", "max_tokens", "chat_template_kwargs", "reasoning_effort")


class MixError(ValueError):
    """A --mix that cannot be used (named in the message)."""


@dataclass(frozen=True)
class Variant:
    name: str
    weight: float
    overrides: dict[str, Any] = field(default_factory=dict)  # the sampling fields it sets

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight, **self.overrides}


def load_mix(text: str) -> list[Variant]:
    """Variants from `text`: a JSON/YAML list, inline, or the path of a file holding one."""
    path = Path(text)
    inline = text.lstrip().startswith(("[", "{", "-"))
    if not inline and path.suffix in (".json", ".yaml", ".yml") and not path.is_file():
        raise MixError(f"--mix file {text} not found")
    source = path.read_text() if not inline and path.is_file() else text
    try:
        data = yaml.safe_load(source)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise MixError(f"--mix is neither a file nor JSON/YAML: {exc}") from None
    if not isinstance(data, list) or not data:
        raise MixError("--mix wants a non-empty list of variants, e.g. "
                       '[{"weight": 1, "chat_template_kwargs": {"enable_thinking": true}}, {"weight": 1}]')
    variants = [_variant(i, v) for i, v in enumerate(data)]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise MixError(f"--mix variant names must differ: {names}")
    return variants


def _variant(i: int, raw: Any) -> Variant:
    where = f"--mix variant {i}"
    if not isinstance(raw, dict):
        raise MixError(f"{where}: a mapping of settings, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(VARIANT_KEYS))
    if unknown:
        raise MixError(f"{where}: unknown settings {unknown}; a variant may set {', '.join(VARIANT_KEYS)}")
    weight = raw.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise MixError(f"{where}: weight must be a positive number, got {weight!r}")
    o = {k: raw[k] for k in VARIANT_KEYS[2:] if k in raw}
    _check_number(where, o, "temperature", 0.0, 2.0, float)
    _check_number(where, o, "top_p", 1e-9, 1.0, float)
    _check_number(where, o, "max_tokens", 1, None, int)
    kwargs = o.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise MixError(f"{where}: chat_template_kwargs must be a mapping")
    if "reasoning_effort" in o and not isinstance(o["reasoning_effort"], str):
        raise MixError(f"{where}: reasoning_effort must be a string such as low, medium, high")
    return Variant(str(raw.get("name", f"v{i}")), float(weight), o)


def _check_number(where: str, o: dict, key: str, low: float, high: float | None, kind: type) -> None:
    if key not in o:
        return
    v = o[key]
    ok = not isinstance(v, bool) and isinstance(v, (int, float) if kind is float else int)
    if not ok or v < low or (high is not None and v > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise MixError(f"{where}: {key} must be a{'n integer' if kind is int else ' number'} {bound}, got {v!r}")


def pick(variants: list[Variant], seed: int | None, key: str) -> Variant:
    """The variant of the conversation `key`: a point in [0, 1) hashed from the run's seed
    and the key, placed on the variants' cumulative weights."""
    digest = hashlib.sha256(f"mix:{seed}:{key}".encode()).digest()
    point = int.from_bytes(digest[:8], "little") / 2**64 * sum(v.weight for v in variants)
    for v in variants:
        point -= v.weight
        if point < 0:
            return v
    return variants[-1]


def describe(variants: list[Variant] | None) -> list[dict[str, Any]] | None:
    """The mix as the plan and the manifest record it."""
    return None if variants is None else json.loads(json.dumps([v.as_dict() for v in variants]))
