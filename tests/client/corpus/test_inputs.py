"""Input readers and sample planning (hsx_client.corpus.inputs)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hsx_client.corpus.inputs import BadRow, read_samples

from _corpus_helpers import FIXTURES

CHAT = FIXTURES / "chat"
needs_fixtures = pytest.mark.skipif(
    not CHAT.is_dir(), reason=f"real chat fixtures not found at {CHAT} (../shared/fixtures is absent)"
)

OASST = CHAT / "oasst" / "threads.messages.jsonl"
GLAIVE = CHAT / "llamafactory" / "glaive_toolcall_en_demo.json"
ALPACA = CHAT / "llamafactory" / "alpaca_en_demo.json"
MTQ = CHAT / "mt_bench" / "question.jsonl"
MTA = CHAT / "mt_bench" / "llama-2-chat-70b-fp16-base-in-temperature-0.0.jsonl"


def _check_chat_samples(samples, policy):
    assert len({s.key for s in samples}) == len(samples), "keys must be unique"
    for s in samples:
        msgs = s.request["messages"]
        assert msgs[-1]["role"] == "assistant"
        assert s.request["assistant_mask"] == ("last" if policy == "per_turn" else "all")
        assert set(s.request) <= {"messages", "tools", "assistant_mask"}


@needs_fixtures
@pytest.mark.fixtures
@pytest.mark.parametrize("policy", ["per_turn", "all_turns"])
def test_oasst_threads(policy):
    rows = [json.loads(line) for line in OASST.read_text().splitlines() if line.strip()]
    n_assistant = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    bad: list[BadRow] = []
    samples = read_samples([str(OASST)], mask_policy=policy, bad_rows=bad)
    assert bad == []
    assert len(samples) == (n_assistant if policy == "per_turn" else len(rows))
    _check_chat_samples(samples, policy)
    first = samples[0]
    assert first.key.startswith("threads.messages.jsonl:1:")
    assert first.source == f"{OASST}:1"
    if policy == "per_turn":
        # the k-th sample of a thread holds the thread up to its k-th assistant turn
        t1 = [s for s in samples if s.key.startswith("threads.messages.jsonl:1:")]
        full = rows[0]["messages"]
        for k, s in enumerate(t1, 1):
            upto = [j for j, m in enumerate(full) if m["role"] == "assistant"][k - 1]
            assert s.request["messages"] == full[: upto + 1]
            assert s.key == f"threads.messages.jsonl:1:t{k}"


@needs_fixtures
@pytest.mark.fixtures
def test_glaive_toolcall_sharegpt():
    raw = json.loads(GLAIVE.read_text())
    speakers = Counter(t["from"] for r in raw for t in r["conversations"])
    bad: list[BadRow] = []
    per_turn = read_samples([str(GLAIVE)], bad_rows=bad)
    assert bad == []
    # function_call turns are assistant turns too
    assert len(per_turn) == speakers["gpt"] + speakers["function_call"]
    all_turns = read_samples([str(GLAIVE)], mask_policy="all_turns")
    assert len(all_turns) == len(raw)
    _check_chat_samples(per_turn, "per_turn")
    _check_chat_samples(all_turns, "all_turns")

    conv = raw[0]["conversations"]
    s = all_turns[0]
    roles = [m["role"] for m in s.request["messages"]]
    mapping = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
    assert roles == [mapping[t["from"]] for t in conv][: len(roles)]
    call = next(t["value"] for t in conv if t["from"] == "function_call")
    assert {"role": "assistant", "content": call} in s.request["messages"]
    # glaive's tools is a JSON string: parsed to a list of function specs
    assert s.request["tools"] == json.loads(raw[0]["tools"])
    assert isinstance(s.request["tools"], list) and s.request["tools"][0]["name"]


@needs_fixtures
@pytest.mark.fixtures
@pytest.mark.parametrize("policy", ["per_turn", "all_turns"])
def test_alpaca(policy):
    raw = json.loads(ALPACA.read_text())
    samples = read_samples([str(ALPACA)], mask_policy=policy)
    assert len(samples) == len(raw)
    _check_chat_samples(samples, policy)
    with_input = next(i for i, r in enumerate(raw) if r.get("input"))
    msgs = samples[with_input].request["messages"]
    r = raw[with_input]
    assert msgs == [
        {"role": "user", "content": r["instruction"] + "\n\n" + r["input"]},
        {"role": "assistant", "content": r["output"]},
    ]
    assert samples[with_input].key == f"alpaca_en_demo.json:{with_input + 1}:" + (
        "t1" if policy == "per_turn" else "all"
    )


@needs_fixtures
@pytest.mark.fixtures
def test_mt_bench():
    # questions alone: user turns only -> every row is a BadRow, nothing planned
    bad: list[BadRow] = []
    assert read_samples([str(MTQ)], bad_rows=bad) == []
    assert len(bad) == 80 and all("no assistant turn" in b.reason for b in bad)
    assert bad[0].source == f"{MTQ}:1"
    # answers alone: no questions to pair with
    bad = []
    assert read_samples([str(MTA)], bad_rows=bad) == []
    assert len(bad) == 80 and "without its question" in bad[0].reason
    # both: joined by question_id into two-turn conversations
    bad = []
    per_turn = read_samples([str(MTQ), str(MTA)], bad_rows=bad)
    assert bad == [] and len(per_turn) == 160
    all_turns = read_samples([str(MTQ), str(MTA)], mask_policy="all_turns")
    assert len(all_turns) == 80
    q = json.loads(MTQ.read_text().splitlines()[0])
    a = json.loads(MTA.read_text().splitlines()[0])
    assert q["question_id"] == a["question_id"]
    assert [m["content"] for m in all_turns[0].request["messages"]] == [
        q["turns"][0], a["choices"][0]["turns"][0], q["turns"][1], a["choices"][0]["turns"][1]
    ]
    _check_chat_samples(per_turn, "per_turn")


@needs_fixtures
@pytest.mark.fixtures
def test_all_fixture_files_together_unique_keys():
    paths = [str(p) for p in (OASST, GLAIVE, ALPACA, MTQ, MTA)]
    a = read_samples(paths)
    b = read_samples(paths)
    assert [s.key for s in a] == [s.key for s in b]  # stable plan
    assert len({s.key for s in a}) == len(a)
    assert read_samples(paths, max_samples=10) == a[:10]


def test_bad_rows_are_reported_with_line_numbers(tmp_path):
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        "",
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"foo": 1}),
        json.dumps({"messages": []}),
        json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                    "tools": "[not json"}),
        json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}),
        json.dumps({"prompt": "Once upon a time"}),
        json.dumps({"text": "plain text"}),
        json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}),
        json.dumps({"input_ids": [5, 6]}),
        json.dumps({"conversations": [{"from": "alien", "value": "?"}]}),
        json.dumps({}),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    bad: list[BadRow] = []
    samples = read_samples([str(path)], bad_rows=bad)
    by_line = {int(b.source.rsplit(":", 1)[1]): b.reason for b in bad}
    assert sorted(by_line) == [3, 4, 5, 6, 7, 8, 9, 14, 15]
    assert "invalid JSON" in by_line[3]
    assert "not an object" in by_line[4]
    assert "unknown row shape" in by_line[5]
    assert "empty" in by_line[6]
    assert "no assistant turn" in by_line[7]
    assert "tools" in by_line[8]
    assert "loss_mask" in by_line[9]
    assert "unknown speaker" in by_line[14]
    assert "empty row" in by_line[15]
    assert all(b.source.startswith(str(path) + ":") for b in bad)
    assert [s.key for s in samples] == ["mixed.jsonl:1:t1", "mixed.jsonl:10", "mixed.jsonl:11",
                                        "mixed.jsonl:12", "mixed.jsonl:13"]
    assert samples[1].request == {"prompt": "Once upon a time"}
    assert samples[2].request == {"prompt": "plain text"}
    assert samples[3].request == {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    assert samples[4].request == {"input_ids": [5, 6]}


def test_per_turn_vs_all_turns_and_tools(tmp_path):
    row = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "Welcome."},
            {"role": "user", "content": "trailing question"},
        ],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
    }
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([row]))
    per = read_samples([str(path)])
    assert [s.key for s in per] == ["chat.json:1:t1", "chat.json:1:t2", "chat.json:1:t3"]
    assert [len(s.request["messages"]) for s in per] == [3, 5, 7]
    assert "content" not in per[0].request["messages"][2]  # None dropped, tool_calls kept
    assert all(s.request["tools"] == row["tools"] for s in per)
    (one,) = read_samples([str(path)], mask_policy="all_turns")
    assert one.key == "chat.json:1:all"
    assert one.request["messages"] == [
        {k: v for k, v in m.items() if v is not None} for m in row["messages"][:7]
    ]
    assert one.request["assistant_mask"] == "all"
    with pytest.raises(ValueError, match="mask_policy"):
        read_samples([str(path)], mask_policy="sometimes")


def test_json_file_holding_json_lines_and_alpaca_extras(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text(
        json.dumps({"instruction": "Add", "input": "1+1", "output": "2", "system": "math",
                    "history": [["hi", "hello"]]}) + "\n"
        + json.dumps({"instruction": "", "output": "x"}) + "\n"
    )
    bad: list[BadRow] = []
    (s,) = read_samples([str(path)], mask_policy="all_turns", bad_rows=bad)
    assert s.request["messages"] == [
        {"role": "system", "content": "math"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Add\n\n1+1"},
        {"role": "assistant", "content": "2"},
    ]
    assert [b.source for b in bad] == [f"{path}:2"]


def test_missing_file_is_fatal(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_samples([str(missing)])


def test_same_file_name_in_two_directories(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.jsonl").write_text(json.dumps({"prompt": d}) + "\n")
    samples = read_samples([str(tmp_path / "a" / "x.jsonl"), str(tmp_path / "b" / "x.jsonl")])
    assert len({s.key for s in samples}) == 2


def test_hf_dataset_directories(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
                      {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]}
        for i in range(5)
    ]
    d1 = tmp_path / "chat_ds"
    datasets.Dataset.from_list(rows).save_to_disk(str(d1))
    per = read_samples([str(d1)])
    assert len(per) == 10 and per[0].key == "chat_ds:1:t1" and per[0].source == f"{d1}:1"
    assert per[1].request["messages"] == rows[0]["messages"]

    # speculators-style pre-tokenized, torch-formatted, inside a DatasetDict
    tok = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
                                      {"input_ids": [4, 5], "loss_mask": [1, 1]}])
    tok.set_format("torch")
    d2 = tmp_path / "tok_dd"
    datasets.DatasetDict({"train": tok}).save_to_disk(str(d2))
    got = read_samples([str(d2)])
    assert [s.request for s in got] == [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
                                       {"input_ids": [4, 5], "loss_mask": [1, 1]}]

    # a plain folder of json files: load_dataset
    d3 = tmp_path / "raw_folder"
    d3.mkdir()
    (d3 / "part.jsonl").write_text("\n".join(json.dumps({"text": f"t{i}"}) for i in range(3)) + "\n")
    assert len(read_samples([str(d3)])) == 3


def test_hub_id_unreachable_gives_clear_error(monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="org/name.*not reachable"):
        read_samples(["hf:org/name:test"])
