"""Dataset rows: JSONL / Parquet / saved `datasets` loading, malformed rows, synthetic rows,
and the seeded sampler's determinism, epochs and exact resume."""

from __future__ import annotations

import collections
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlasync.data import DatasetError, Problem, RowSampler, load_rows, make_problems, synthetic_rows

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
needs_pyarrow = pytest.mark.skipif(
    not HAS_PYARROW, reason="pyarrow is not installed (optional: pip install pyarrow)"
)
needs_datasets = pytest.mark.skipif(
    not HAS_DATASETS, reason="`datasets` is not installed (optional: pip install datasets)"
)

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
RECORDS: list[dict[str, Any]] = [
    {"prompt": "What is 2+2?", "answer": "4", "uid": "a", "level": 1},
    {
        "messages": [{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi"}],
        "answer": "hello",
        "agent_name": "tool",
        "tools": [TOOL],
        "uid": "b",
        "level": 2,
    },
    {"prompt": [{"role": "user", "content": "Reverse abc"}], "answer": "cba", "uid": "c", "level": 3},
]

# A columnar column holds one type: a string-prompt column cannot also hold message lists.
# Every row has every column (null where a row had none), as a table does.
_COLUMNAR = [
    *RECORDS[:2],
    {**{k: v for k, v in RECORDS[2].items() if k != "prompt"}, "messages": RECORDS[2]["prompt"]},
]
COLUMNAR = [
    {k: r.get(k) for k in ("prompt", "messages", "answer", "agent_name", "tools", "uid", "level")}
    for r in _COLUMNAR
]


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def check_rows(rows: list[dict[str, Any]], *, system: str | None) -> None:
    head = [{"role": "system", "content": system}] if system else []
    assert rows[0]["messages"] == [*head, {"role": "user", "content": "What is 2+2?"}]
    assert rows[0]["ground_truth"] == "4" and rows[0]["level"] == 1 and rows[0]["uid"] == "a"
    assert "prompt" not in rows[0] and "answer" not in rows[0] and "agent_name" not in rows[0]
    # A row's own system message is kept, never replaced or doubled.
    assert rows[1]["messages"] == [
        {"role": "system", "content": "Own system."},
        {"role": "user", "content": "Hi"},
    ]
    assert (
        rows[1]["agent_name"] == "tool" and rows[1]["tools"] == [TOOL] and rows[1]["ground_truth"] == "hello"
    )
    assert rows[2]["messages"] == [*head, {"role": "user", "content": "Reverse abc"}]
    assert [r["level"] for r in rows] == [1, 2, 3]


# -- JSONL ------------------------------------------------------------------------------------
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_jsonl_string_and_message_prompts(tmp_path: Path, system: str | None) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [*RECORDS[:2], "", *RECORDS[2:]])  # a blank line is skipped
    check_rows(load_rows(path, answer_key="answer", system_prompt=system), system=system)


def test_jsonl_keeps_ground_truth_and_custom_prompt_key(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "q.jsonl", [{"question": "Why?", "ground_truth": "because", "extra": [1, 2]}]
    )
    (row,) = load_rows(path, prompt_key="question")
    assert row == {
        "messages": [{"role": "user", "content": "Why?"}],
        "ground_truth": "because",
        "extra": [1, 2],
    }


def test_split_reads_a_file_in_a_directory(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "val.jsonl", [{"prompt": "v"}])
    assert load_rows(tmp_path, split="val")[0]["messages"] == [{"role": "user", "content": "v"}]
    with pytest.raises(DatasetError, match="neither test.jsonl nor test.parquet"):
        load_rows(tmp_path, split="test")
    with pytest.raises(DatasetError, match="split="):
        load_rows(tmp_path)
    with pytest.raises(DatasetError, match="single file"):
        load_rows(tmp_path / "val.jsonl", split="val")


@pytest.mark.parametrize(
    ("line", "where", "field", "problem"),
    [
        ({"answer": "4"}, "line 3", "prompt", "missing"),
        ({"prompt": 7}, "line 3", "prompt", "expected a string or a list of messages, got int"),
        ({"prompt": "  "}, "line 3", "prompt", "empty"),
        ({"messages": []}, "line 3", "messages", "non-empty list"),
        ({"messages": "hi"}, "line 3", "messages", "got str"),
        ({"messages": [{"role": "user", "content": "a"}, "b"]}, "line 3", "messages[1]", "message object"),
        ({"messages": [{"content": "a"}]}, "line 3", "messages[0].role", "role string"),
        ({"messages": [{"role": "user"}]}, "line 3", "messages[0].content", "missing"),
        ({"messages": [{"role": "user", "content": 5}]}, "line 3", "messages[0].content", "got int"),
        ({"prompt": "a", "agent_name": 3, "answer": "x"}, "line 3", "agent_name", "agent loop"),
        (
            {"prompt": "a", "tools": {"type": "function"}, "answer": "x"},
            "line 3",
            "tools",
            "list of tool schemas",
        ),
        ({"prompt": "a", "tools": "[oops", "answer": "x"}, "line 3", "tools", "not JSON"),
        ({"prompt": "a", "uid": 1.5, "answer": "x"}, "line 3", "uid", "got float"),
        ({"prompt": "a"}, "line 3", "answer", "missing"),  # answer_key="answer" below
        ("[1, 2]", "line 3", None, "expected a JSON object, got list"),
        ("{not json", "line 3", None, "invalid JSON"),
    ],
)
def test_malformed_rows_name_file_line_and_field(
    tmp_path: Path, line: Any, where: str, field: str | None, problem: str
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, "", line])
    with pytest.raises(DatasetError) as info:
        load_rows(path, answer_key="answer")
    error = info.value
    assert (error.source, error.where, error.field) == (str(path), where, field)
    assert problem in error.problem
    assert str(path) in str(error) and where in str(error) and (field is None or repr(field) in str(error))


def test_tool_schemas_as_json_string_and_assistant_without_content(tmp_path: Path) -> None:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "tool_calls": [call]}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": messages, "tools": json.dumps([TOOL])}])
    (row,) = load_rows(path)
    assert row["tools"] == [TOOL] and row["messages"] == messages


def test_unknown_format_and_missing_path(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(DatasetError, match="unknown format '.csv'"):
        load_rows(tmp_path / "x.csv")
    with pytest.raises(DatasetError, match="no such file"):
        load_rows(tmp_path / "absent.jsonl")


# -- Parquet ----------------------------------------------------------------------------------
@needs_pyarrow
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_parquet_round_trip(tmp_path: Path, system: str | None) -> None:
    import pyarrow as pa  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]

    # Columnar: a prompt column that is null where a row has messages and vice versa, a tools
    # column null in most rows, message structs with keys other messages lack.
    pq.write_table(pa.Table.from_pylist(COLUMNAR), tmp_path / "train.parquet")
    rows = load_rows(tmp_path / "train.parquet", answer_key="answer", system_prompt=system)
    check_rows(rows, system=system)
    assert "tools" not in rows[0] and "agent_name" not in rows[2]


@needs_pyarrow
def test_parquet_prompt_column_of_messages(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]

    # verl's layout: `prompt` is a list of messages, the answer nested in another column.
    records = [{"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "v.parquet")
    (row,) = load_rows(tmp_path / "v.parquet")
    assert row == {
        "messages": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"ground_truth": "4"},
        "ground_truth": "4",  # verl's answer is the row's ground truth
    }


@needs_pyarrow
def test_verl_layout_needs_its_ground_truth_and_names_the_row_and_column(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]

    prompt = [{"role": "user", "content": "2+2?"}]
    records = [
        {
            "prompt": prompt,
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "agent_name": "tool_agent",
        },
        {
            "prompt": prompt,
            "reward_model": {"style": "rule", "ground_truth": None},
            "agent_name": "single_turn_agent",
        },
    ]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "v.parquet")
    with pytest.raises(DatasetError, match=r"v.parquet: row 1: field 'reward_model.ground_truth': missing"):
        load_rows(tmp_path / "v.parquet")
    pq.write_table(pa.Table.from_pylist(records[:1]), tmp_path / "ok.parquet")
    (row,) = load_rows(tmp_path / "ok.parquet")
    assert row["agent_name"] == "tool" and row["ground_truth"] == "4"  # verl's loop names are ours


@needs_pyarrow
def test_verl_tools_and_interaction_kwargs_become_the_rows(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]

    prompt = [{"role": "user", "content": "2+2?"}]
    truth = {"style": "rule", "ground_truth": "4"}
    tools = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "4"}}}
    interaction = {"name": "gsm8k", "query": "2+2?", "ground_truth": "4"}
    records = [
        {
            "prompt": prompt,
            "reward_model": truth,
            "extra_info": {"index": 0, "tools_kwargs": tools, "interaction_kwargs": interaction},
        },
        {"prompt": prompt, "reward_model": truth, "extra_info": {"index": 1}},  # a column's nulls: none
    ]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "v.parquet")
    first, second = load_rows(tmp_path / "v.parquet")
    assert first["tools_kwargs"] == tools and first["interaction_kwargs"] == interaction
    assert "tools_kwargs" not in second and "interaction_kwargs" not in second
    bad = [{"prompt": prompt, "reward_model": truth, "extra_info": {"tools_kwargs": {"calc": 3}}}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(
        DatasetError, match=r"bad.parquet: row 0: field 'extra_info.tools_kwargs': expected \{tool name"
    ):
        load_rows(tmp_path / "bad.parquet")


@needs_pyarrow
def test_parquet_nulls_of_other_rows_structs_are_dropped(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]

    def tool(name: str, prop: str, kind: str) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {"type": "object", "properties": {prop: {"type": kind}}},
            },
        }

    call = {"type": "function", "function": {"name": "a", "arguments": "{}"}}
    records: list[dict[str, Any]] = [
        {
            "messages": [
                {"role": "user", "content": "p"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
            ],
            "tools": [tool("a", "x", "string")],
        },
        {"messages": [{"role": "user", "content": "q"}], "tools": [tool("b", "y", "integer")]},
    ]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "t.parquet")
    rows = load_rows(tmp_path / "t.parquet")
    # Arrow gave row 1 a `tool_calls: None` and a property `x: None`; row 0 a property `y: None`.
    assert [r["messages"] for r in rows] == [r["messages"] for r in records]
    assert [r["tools"] for r in rows] == [r["tools"] for r in records]


@needs_pyarrow
def test_parquet_malformed_row_is_named(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]

    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]),
        tmp_path / "d.parquet",
    )
    with pytest.raises(DatasetError) as info:
        load_rows(tmp_path / "d.parquet")
    assert (info.value.where, info.value.field) == ("row 1", "prompt")


def test_parquet_without_pyarrow_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_rows(tmp_path / "d.parquet")


# -- Hugging Face datasets saved to disk ------------------------------------------------------
@needs_datasets
def test_hf_saved_to_disk(tmp_path: Path) -> None:
    import datasets  # type: ignore[import-not-found, import-untyped, unused-ignore]

    records = [{k: v for k, v in r.items() if k != "tools"} for r in COLUMNAR]  # tools: see below
    records[1]["tools"] = json.dumps([TOOL])  # a JSON string keeps a schema intact in Arrow
    for r in records[::2]:
        r["tools"] = None
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "single"))
    check_rows(load_rows(tmp_path / "single", answer_key="answer"), system=None)

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records[:1])}
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    check_rows(
        load_rows(tmp_path / "dict", split="train", answer_key="answer", system_prompt="S"), system="S"
    )
    assert len(load_rows(tmp_path / "dict", split="test", answer_key="answer")) == 1
    with pytest.raises(DatasetError, match="choose one with split="):
        load_rows(tmp_path / "dict")
    with pytest.raises(DatasetError, match="no split 'val'"):
        load_rows(tmp_path / "dict", split="val")
    with pytest.raises(DatasetError, match="not a DatasetDict"):
        load_rows(tmp_path / "single", split="train")


def test_hf_without_datasets_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_rows(tmp_path / "saved")


# -- synthetic --------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["reverse", "arith", "calc"])
def test_synthetic_rows(task: str) -> None:
    rows = synthetic_rows(task, 12, seed=1, split="val")
    problems = make_problems(task, 12, seed=1, split="val")
    assert [r["problem"] for r in rows] == problems
    for row, p in zip(rows, problems):
        assert isinstance(row["problem"], Problem)
        assert row["messages"] == p.messages and row["ground_truth"] == p.answer
        assert row.get("agent_name") == ("tool" if task == "calc" else None)  # else agent.default_loop
        assert row.get("tools") == p.tools and (task == "calc") == ("tools" in row)
    assert len({r["uid"] for r in rows}) == 12
    assert synthetic_rows(task, 12, seed=1, split="val") == rows
    train = {r["uid"] for r in synthetic_rows(task, 30, seed=1, split="train")}
    assert not train & {r["uid"] for r in rows}  # the held-out split stays held out


def _length_mix(rows: list[Any]) -> dict[int, float]:
    counts = collections.Counter(len(r["ground_truth"]) for r in rows)
    return {n: counts[n] / len(rows) for n in range(3, 7)}


def test_training_rows_follow_the_task_s_own_length_mix() -> None:
    """Why fully async quickstarts held out at 0.8 with a training reward of 0.99 (issue 48):
    every failure was a three-letter word, and the training rows hardly had any. 20,000
    *distinct* training problems use up the 460 three-letter words of the training split, so
    they were 2.4 % of training, while the task draws a length uniformly from 3 to 6 and the
    128 held-out problems have 12-20 % of them. Whether a run then generalised to them from
    longer words was luck. Training rows are now drawn as the task draws (repeats kept)."""
    from rlasync.compose.feed import read_rows
    from rlasync.config import load_config

    config = load_config(Path(__file__).parents[2] / "configs" / "quickstart_async.yaml")
    train, val = read_rows(config)
    assert len(train) == config.data.synthetic_train_size and len({r["uid"] for r in train}) == len(train)
    # Each length is 1/4 of the task's draws (and of its training split, a hash of the word):
    # with 20,000 rows a share's standard deviation is sqrt(0.25 * 0.75 / 20,000) = 0.003.
    assert all(abs(share - 0.25) < 0.02 for share in _length_mix(train).values()), _length_mix(train)
    distinct = synthetic_rows("reverse", len(train), seed=config.train.seed, split="train")
    assert _length_mix(distinct)[3] < 0.03  # the old draw: three-letter words used up
    assert _length_mix(val)[3] > 0.1  # ...which validation asks about at every check


# -- sampler ----------------------------------------------------------------------------------
ROWS = [{"i": i} for i in range(10)]


def ids(batch: list[dict[str, Any]]) -> list[int]:
    return [row["i"] for row in batch]


def test_sampler_is_deterministic_and_seeded() -> None:
    a = [ids(RowSampler(ROWS, seed=3).next_batch(7)) for _ in range(2)]
    assert a[0] == a[1]
    assert ids(RowSampler(ROWS, seed=4).next_batch(10)) != ids(RowSampler(ROWS, seed=3).next_batch(10))
    assert ids(RowSampler(ROWS, seed=3, shuffle=False).next_batch(10)) == list(range(10))


def test_each_epoch_is_a_permutation_and_batches_span_epochs() -> None:
    sampler = RowSampler(ROWS, seed=0)
    seen = [i for _ in range(10) for i in ids(sampler.next_batch(3))]  # 30 rows: exactly 3 epochs
    epochs = [seen[k : k + 10] for k in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert (sampler.epoch, sampler.position) == (2, 10)
    assert ids(sampler.next_batch(2)) == sampler.order(3)[:2]
    assert (sampler.epoch, sampler.position) == (3, 2)


def test_drop_last_never_spans_epochs() -> None:
    sampler = RowSampler(ROWS, seed=0, drop_last=True)
    batches = [ids(sampler.next_batch(4)) for _ in range(4)]  # 2 per epoch, 2 rows of each skipped
    assert batches[0] + batches[1] == sampler.order(0)[:8]
    assert batches[2] + batches[3] == sampler.order(1)[:8]
    with pytest.raises(ValueError, match="cannot fit"):
        sampler.next_batch(11)


def test_batches_are_copies() -> None:
    sampler = RowSampler(ROWS, seed=0, shuffle=False)
    sampler.next_batch(1)[0]["i"] = 99
    assert ROWS[0] == {"i": 0} and sampler.rows[0] == {"i": 0}


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("stop_after", [0, 1, 3, 5])
def test_resume_from_state_continues_exactly(drop_last: bool, stop_after: int) -> None:
    sizes = [3, 4, 1, 6, 2, 5, 3, 4]
    uninterrupted = RowSampler(ROWS, seed=11, drop_last=drop_last)
    expected = [ids(uninterrupted.next_batch(n)) for n in sizes]

    first = RowSampler(ROWS, seed=11, drop_last=drop_last)
    got = [ids(first.next_batch(n)) for n in sizes[:stop_after]]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = RowSampler(ROWS, seed=999, drop_last=drop_last)  # the state's seed wins
    resumed.load_state_dict(state)
    got += [ids(resumed.next_batch(n)) for n in sizes[stop_after:]]
    assert got == expected


def test_state_for_other_data_is_refused() -> None:
    state = RowSampler(ROWS, seed=0).state_dict()
    with pytest.raises(ValueError, match="10 rows"):
        RowSampler(ROWS[:5], seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="at least one row"):
        RowSampler([], seed=0)


def test_data_module_imports_no_torch() -> None:
    code = "import sys, rlasync.data.datasets; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
