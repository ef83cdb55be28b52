"""The corpus side's defaults from one owner each: the usable core count (hsx.host, the
process's CPU affinity, not the machine's count) and the exit codes' text (extract.EXIT_CODES)."""

from __future__ import annotations

import os

import pytest

from hsx_client.corpus import cli, extract, run
from hsx_client.corpus.merge import Merger


@pytest.fixture
def two_of_sixty_four(monkeypatch):
    """A container limited to 2 cores of a 64-core machine."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_thread_defaults_follow_the_usable_cores_not_the_machine(two_of_sixty_four, tmp_path):
    assert run.default_write_workers() == 4
    assert Merger(tmp_path / "out", []).workers == 4


def test_extract_help_prints_every_exit_code_from_exit_codes():
    help_text = " ".join(cli.build_extract_parser().format_help().split())
    for code, text in extract.EXIT_CODES.items():
        assert f" {code} {' '.join(text.split())}" in help_text


def test_corpus_settings_are_plan_json_s_object_field_for_field():
    """plan.json's "settings" keep their keys and order (global fingerprints hash them: merge
    proves shards from one plan with it); a plan from before `states`/`dtype` reads with their defaults."""
    from hsx_client.corpus.settings import CorpusSettings

    legacy = {"format": "speculators", "mask_policy": "per_turn", "max_length": 64, "truncation": "right",
              "layers": [1, 2], "draft_vocab_size": None, "seed": 0, "shuffle": True, "max_samples": None}
    s = CorpusSettings.saved(legacy)
    assert (s.format, s.layers, s.states, s.dtype) == ("speculators", [1, 2], "all", "auto")
    assert list(s.to_saved()) == [*legacy, "states", "dtype", "draft"]
    assert {k: v for k, v in s.to_saved().items() if k in legacy} == legacy


def test_every_format_has_every_member_of_the_protocol_and_one_final_norm_rule():
    """CorpusFormat declares needs_final_norm, layer_problem, prepare, fetch, drop_reason: no
    getattr default elsewhere. Before, a format without needs_final_norm was taken as not
    needing the norm by the pre-flight check and as needing it when the run fetched it."""
    from hsx_client.corpus.formats import CorpusFormat, FormatDefaults, SpecForgeFormat, SpeculatorsFormat
    from hsx_client.corpus.formats.speculators_variants import SpeculatorsFp8Format, SpeculatorsTokensFormat
    from hsx_client.corpus.plan import ConfigError
    from hsx_client.corpus.preflight import preflight, wants_final_norm
    from hsx_client.corpus.settings import CorpusSettings

    members = {"name", "needs_final_norm", *(m for m in vars(CorpusFormat) if not m.startswith("_"))}
    assert {"layer_problem", "prepare", "fetch", "drop_reason"} <= members
    for cls in (SpeculatorsFormat, SpecForgeFormat, SpeculatorsTokensFormat, SpeculatorsFp8Format):
        assert all(hasattr(cls, m) for m in members), cls

    class Bare(FormatDefaults):
        name = "bare"

    info = {"layer_ids": [1, 2, 3, 4], "final_norm": None}
    assert wants_final_norm(Bare(), info)
    with pytest.raises(ConfigError, match="final norm"):
        preflight(Bare(), CorpusSettings(format="bare"), info, {"http://s": info})
