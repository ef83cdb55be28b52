"""The corpus settings: what a plan fixes (format, lengths, layers, sampling, variant), one
typed object read by attribute. On disk they stay the plain `"settings"` object of
plan.json, field for field in this order (`saved()` reads it, `to_saved()` writes it), so
corpora written before this class still resume, verify and merge."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ConfigError(Exception):
    """The run cannot start as asked (exit 2)."""


class CorpusSettings(BaseModel):
    # Assignment stays open: extract fills `layers` and `max_length` from the servers before the plan is written.
    model_config = ConfigDict(extra="ignore")

    format: str | None = None
    mask_policy: Literal["per_turn", "all_turns"] = "per_turn"
    max_length: int | None = None
    truncation: Literal["right", "left", "error"] = "right"
    layers: list[int] | None = None
    draft_vocab_size: int | None = None
    seed: int = 0
    shuffle: bool = True
    max_samples: int | None = None
    states: Literal["all", "none"] = "all"  # none: the token table only (online training; formats/speculators_variants.py)
    dtype: Literal["auto", "fp8"] = "auto"  # fp8: states stored as fp8 with per-token scales
    draft: str = "eagle3"  # the draft the corpus trains (client/corpus/drafts.py): its layers and records

    @classmethod
    def saved(cls, settings: dict[str, Any]) -> CorpusSettings:
        """A plan's (or corpus's) settings; a field an older plan lacks takes its default."""
        return cls.model_validate(settings)

    def to_saved(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def resolve(cls, given: dict[str, Any], plan: dict[str, Any] | None, out: Path) -> CorpusSettings:
        """Merge the command line (`given`: field -> value, None: not given) with the plan:
        given flags must agree with it; missing ones come from it, else the defaults."""
        defaults = cls.model_construct().model_dump()
        if plan is None:
            return cls(**{k: v for k, v in given.items() if v is not None})
        saved = plan["settings"]
        diffs = []
        for k, v in given.items():
            if v is not None and k in saved and saved[k] is not None and v != saved[k]:
                diffs.append(f"--{k.replace('_', '-')}: the plan has {saved[k]!r}, this run asks {v!r}")
            elif v is not None and k in saved and saved[k] is None and v != defaults[k]:
                diffs.append(f"--{k.replace('_', '-')}: the plan has none, this run asks {v!r}")
            elif v is not None and k not in saved and v != defaults[k]:  # a plan from before the setting
                diffs.append(f"--{k.replace('_', '-')}: the plan has the default {defaults[k]!r}, this run asks {v!r}")
        if diffs:
            raise ConfigError(
                f"{out} holds a run made with other settings; resume with the same flags or use a "
                "new --output:\n  " + "\n  ".join(diffs)
            )
        return cls.saved(saved)


PLAN_KEYS = tuple(CorpusSettings.model_fields)  # the command line's names of the same settings
SETTING_DEFAULTS: dict[str, Any] = CorpusSettings.model_construct().model_dump()
