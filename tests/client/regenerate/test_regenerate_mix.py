"""hsx regenerate --mix without an engine: each conversation's variant is a pure function
of the run's seed and its key (so resume, reruns and shards agree), the draw follows the
weights, the variant's settings are what the request carries, and a bad mix is refused."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from hsx_client.regenerate.cli import main as regenerate_main
from hsx_client.regenerate.mix import MixError, load_mix, pick
from hsx_client.regenerate.turns import Sampling, regenerate
from test_regenerate_unit import FakeServer

MIX = [{"name": "think", "weight": 3, "chat_template_kwargs": {"enable_thinking": True}, "temperature": 0.6,
        "reasoning_effort": "high"},
       {"name": "plain", "weight": 1, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 7}]


def test_assignment_is_deterministic_and_follows_the_weights():
    variants = load_mix(json.dumps(MIX))
    keys = [f"chats.jsonl:{n}" for n in range(4000)]
    first = [pick(variants, 11, k).name for k in keys]
    again = load_mix(json.dumps(MIX))
    assert first == [pick(again, 11, k).name for k in keys]  # rerun, resume: the same
    assert [pick(variants, 11, k).name for k in reversed(keys)] == first[::-1]  # order, shards: no effect
    share = Counter(first)["think"] / len(keys)
    assert abs(share - 0.75) < 0.03
    other_seed = [pick(variants, 12, k).name for k in keys]
    assert other_seed != first and abs(Counter(other_seed)["think"] / len(keys) - 0.75) < 0.03
    assert {pick(variants, None, k).name for k in keys} == {"think", "plain"}  # no --seed: still by key


def test_the_variant_settings_are_what_the_requests_carry():
    base = Sampling(max_tokens=32, temperature=0.0, seed=3, chat_template_kwargs={"thinking_budget": 64},
                    mix=load_mix(json.dumps(MIX)))
    seen = set()
    for n in range(40):
        key = f"f:{n}"
        sampling, variant = base.for_conversation(key)
        server = FakeServer()
        asyncio.run(regenerate(key, [{"role": "user", "content": "q"}], None, sampling, server))
        (body,) = server.bodies
        seen.add(variant.name)
        if variant.name == "think":
            assert body["temperature"] == 0.6 and body["max_tokens"] == 32
            assert body["chat_template_kwargs"] == {"thinking_budget": 64, "enable_thinking": True,
                                                    "reasoning_effort": "high"}
        else:
            assert body["temperature"] == 0.0 and body["max_tokens"] == 7
            assert body["chat_template_kwargs"] == {"thinking_budget": 64, "enable_thinking": False}
        assert body["seed"] == base.conversation_seed(key)  # the mix does not move the sampling seed
    assert seen == {"think", "plain"}
    assert Sampling(seed=3).for_conversation("f:1") == (Sampling(seed=3), None)


def test_a_mix_from_a_yaml_file(tmp_path):
    f = tmp_path / "mix.yaml"
    f.write_text("- {name: a, weight: 1, top_p: 0.9}\n- {name: b, weight: 2, reasoning_effort: low}\n")
    a, b = load_mix(str(f))
    assert (a.name, a.weight, a.overrides) == ("a", 1.0, {"top_p": 0.9})
    assert (b.name, b.overrides) == ("b", {"reasoning_effort": "low"})
    assert [v.name for v in load_mix('[{"weight": 1}, {"weight": 1}]')] == ["v0", "v1"]


@pytest.mark.parametrize("mix, words", [
    ("{}", "non-empty list"),
    ("[]", "non-empty list"),
    ('[{"weight": 0}]', "positive"),
    ('[{"weight": -1}]', "positive"),
    ('[{"seed": 1}]', "unknown settings ['seed']"),
    ('[{"temperature": 3}]', "temperature"),
    ('[{"max_tokens": 0.5}]', "max_tokens"),
    ('[{"chat_template_kwargs": "x"}]', "mapping"),
    ('[{"name": "a"}, {"name": "a"}]', "differ"),
    ("[1, 2", "neither a file nor JSON/YAML"),
    ("no-such-mix.yaml", "not found"),
])
def test_a_bad_mix_is_refused_before_any_work(mix, words, tmp_path, capsys):
    with pytest.raises(MixError, match=None) as exc:
        load_mix(mix)
    assert words in str(exc.value)
    rc = regenerate_main(["--server", "http://127.0.0.1:9", "--input", str(tmp_path / "x.jsonl"),
                          "--output", str(tmp_path / "o.jsonl"), "--mix", mix])
    assert rc == 2 and words in capsys.readouterr().err
