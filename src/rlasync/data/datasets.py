"""Dataset rows for the agent loops: JSONL, Parquet, Hugging Face ``datasets`` saved to disk,
and the synthetic tasks; a seeded, resumable sampler over them.

A row is a plain dict, passed as keyword arguments to an agent loop and to the reward:

    {"messages": [{"role": "user", "content": "What is 2+2?"}],   # the prompt, as chat messages
     "ground_truth": "4",          # optional: what rewards compare against
     "agent_name": "single_turn",  # optional: which agent loop (else agent.default_loop)
     "tools": [{...}],             # optional: tool schemas for the chat template
     "uid": "q17",                 # optional: an id of the prompt
     ...}                          # any other field is kept as it is

    rows = load_rows("data/train.jsonl", answer_key="answer", system_prompt="Be brief.")
    sampler = RowSampler(rows, seed=0)
    batch = sampler.next_batch(8)          # a checkpoint stores sampler.state_dict()

``load_rows`` normalises what it reads: a string prompt (``prompt_key``) becomes a user message
after an optional system message; a row that has ``messages`` (or whose prompt is already a
list of messages) keeps them. The prompt field is then dropped (it *is* ``messages`` now), and
``answer_key``, when given, is renamed ``ground_truth``.

verl's layout is read as it is: ``prompt`` as chat messages, ``reward_model: {style,
ground_truth}`` (its ``ground_truth`` is the row's, and required), ``data_source``, ``ability``
and ``extra_info`` kept for the reward (verl's ``compute_score`` reads them), its loop names
in ``agent_name`` (``single_turn_agent``, ``tool_agent``) as ours, and ``extra_info``'s
``tools_kwargs`` and ``interaction_kwargs`` as the row's (a tool call's ``ToolContext.tool_kwargs``;
the interaction its ``name`` picks). A malformed row raises ``DatasetError``
naming the file, the line (JSONL, from 1) or row (Parquet and ``datasets``, from 0), and the field.

Columnar formats (Parquet, ``datasets``) store every key of a struct column in every row, with
nulls where a row had none (a user message gains ``tool_calls: None``; one tool schema gains
the properties of another). Nulls inside ``messages`` and ``tools`` from those formats are
therefore dropped (except a message's ``content``), and a null optional field counts as absent.
``tools`` may also be stored as a JSON string, which is how it survives a columnar format intact.

No torch, and neither pyarrow nor ``datasets`` unless a file needs them (optional: both are
imported lazily and a missing one is named with its install command).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .synthetic import Problem, Split, iter_problems, make_problems

Row = dict[str, Any]
"""One dataset row (see the module docstring for its fields)."""

_OPTIONAL_NON_NULL = ("agent_name", "tools", "uid")

VERL_LOOPS = {"single_turn_agent": "single_turn", "tool_agent": "tool"}
"""verl's names of its agent loops (a row's ``agent_name``) -> ours."""


class DatasetError(ValueError):
    """A dataset that cannot be read, or a malformed row: names the source, row and field."""

    def __init__(
        self, source: str, problem: str, *, where: str | None = None, field: str | None = None
    ) -> None:
        self.source, self.problem, self.where, self.field = source, problem, where, field
        parts = [source] + ([where] if where else []) + ([f"field {field!r}"] if field else [])
        super().__init__(f"{': '.join(parts)}: {problem}")


# -- loading ----------------------------------------------------------------------------------
def load_rows(
    path_or_name: str | os.PathLike[str],
    *,
    split: str | None = None,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    system_prompt: str | None = None,
) -> list[Row]:
    """The rows of a local dataset, normalised (see the module docstring).

    ``path_or_name``: a ``.jsonl`` or ``.parquet`` file; a directory written by
    ``datasets``' ``save_to_disk`` (a ``DatasetDict`` needs ``split`` unless it holds one split);
    or a directory holding ``{split}.jsonl`` or ``{split}.parquet``. Only local data: a dataset
    from the Hub is first saved with ``load_dataset(name).save_to_disk(dir)``.
    ``system_prompt`` is put first in every prompt that does not start with a system message.
    """
    path = Path(path_or_name).expanduser()
    source = str(path_or_name)
    records: Iterable[tuple[int, Any]]
    if not path.exists():
        raise DatasetError(
            source,
            "no such file or directory (rlasync reads local data only; save a Hub "
            "dataset with datasets.load_dataset(name).save_to_disk(dir) first)",
        )
    if path.is_dir():
        if _is_hf_saved(path):
            records, columnar, unit = _read_hf(path, split, source), True, "row"
            split = None
        elif split is None:
            raise DatasetError(
                source,
                "a directory that `datasets` did not save: give a file, or split= to "
                "read {split}.jsonl or {split}.parquet in it",
            )
        else:
            found = [
                path / f"{split}{ext}" for ext in (".jsonl", ".parquet") if (path / f"{split}{ext}").is_file()
            ]
            if not found:
                raise DatasetError(
                    source, f"split {split!r}: neither {split}.jsonl nor {split}.parquet is in it"
                )
            path, source, split = found[0], str(found[0]), None
    elif not path.is_file():
        raise DatasetError(source, "neither a file nor a directory")
    if path.is_file():
        if split is not None:
            raise DatasetError(
                source,
                f"split={split!r} given for a single file (splits are files in a directory, "
                "or splits of a saved DatasetDict)",
            )
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            records, columnar, unit = _read_jsonl(path, source), False, "line"
        elif suffix == ".parquet":
            records, columnar, unit = _read_parquet(path, source), True, "row"
        else:
            raise DatasetError(
                source,
                f"unknown format {suffix or '(no suffix)'!r}: expected .jsonl, .parquet, "
                "or a directory saved by datasets' save_to_disk",
            )
    rows = []
    for index, record in records:
        where = f"{unit} {index}"
        if not isinstance(record, dict):
            raise DatasetError(source, f"expected a JSON object, got {type(record).__name__}", where=where)
        rows.append(
            _normalise(
                record,
                source=source,
                where=where,
                prompt_key=prompt_key,
                answer_key=answer_key,
                system_prompt=system_prompt,
                columnar=columnar,
            )
        )
    return rows


def _read_jsonl(path: Path, source: str) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(
                    source, f"invalid JSON ({e.msg}, column {e.colno})", where=f"line {number}"
                ) from None


def _read_parquet(path: Path, source: str) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError as e:
        raise ImportError(
            f"{source}: reading Parquet needs pyarrow, which is not installed: pip install pyarrow"
        ) from e
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid, OSError, …
        raise DatasetError(source, f"not a readable Parquet file ({e})") from e
    # Batch by batch: a Python list of a whole large table would double its memory at once.
    index = 0
    for batch in table.to_batches():
        for record in batch.to_pylist():
            yield index, record
            index += 1


def _is_hf_saved(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _read_hf(path: Path, split: str | None, source: str) -> Iterator[tuple[int, Any]]:
    try:
        import datasets  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError as e:
        raise ImportError(
            f"{source}: reading a saved Hugging Face dataset needs `datasets`, which is not "
            "installed: pip install datasets"
        ) from e
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        if split is None:
            if len(names) != 1:
                raise DatasetError(source, f"a DatasetDict with splits {names}: choose one with split=")
            split = names[0]
        if split not in loaded:
            raise DatasetError(source, f"no split {split!r}; it has {names}")
        loaded = loaded[split]
    elif split is not None:
        raise DatasetError(source, f"split={split!r} given, but this is a single Dataset, not a DatasetDict")
    return enumerate(loaded)  # rows as Python dicts, read lazily from the Arrow files


def _normalise(
    record: dict[str, Any],
    *,
    source: str,
    where: str,
    prompt_key: str,
    answer_key: str | None,
    system_prompt: str | None,
    columnar: bool,
) -> Row:
    def fail(field: str, problem: str) -> DatasetError:
        return DatasetError(source, problem, where=where, field=field)

    row = dict(record)
    if row.get("messages") is not None:
        messages = _messages(row.pop("messages"), "messages", fail, columnar)
    elif row.get(prompt_key) is not None:
        prompt = row.pop(prompt_key)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise fail(prompt_key, "the prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):  # a prompt column of chat messages (as verl's datasets have)
            messages = _messages(prompt, prompt_key, fail, columnar)
        else:
            raise fail(prompt_key, f"expected a string or a list of messages, got {type(prompt).__name__}")
    else:
        raise fail(prompt_key, "missing: a row needs a prompt (this field) or `messages`")
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    row.pop("messages", None)  # a null `messages` column beside the prompt

    if answer_key is not None:
        if row.get(answer_key) is None:
            raise fail(answer_key, "missing: answer_key names it as the ground truth")
        row["ground_truth"] = row.pop(answer_key)
    elif row.get("reward_model") is not None:  # verl's layout: {style: rule, ground_truth: ...}
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise fail(
                "reward_model.ground_truth",
                "missing: a row in verl's layout keeps its answer here "
                "(reward_model: {style: rule, ground_truth: ...}); give it, or name another column with data.answer_key",
            )
        row["ground_truth"] = reward_model["ground_truth"]
    elif "ground_truth" in row and row["ground_truth"] is None:
        del row["ground_truth"]  # a null in a column: no ground truth for this row
    for key in _OPTIONAL_NON_NULL:
        if key in row and row[key] is None:
            del row[key]
    if "agent_name" in row and (not isinstance(row["agent_name"], str) or not row["agent_name"]):
        raise fail("agent_name", f"expected the name of an agent loop, got {row['agent_name']!r}")
    if row.get("agent_name") in VERL_LOOPS:
        row["agent_name"] = VERL_LOOPS[row["agent_name"]]
    if "tools" in row:
        row["tools"] = _tools(row["tools"], fail, columnar)
    _lift_verl_kwargs(row, fail, columnar)
    if "uid" in row and (isinstance(row["uid"], bool) or not isinstance(row["uid"], str | int)):
        raise fail("uid", f"expected a string or an integer, got {type(row['uid']).__name__}")
    return {"messages": messages, **row}


def _messages(value: Any, field: str, fail: Any, columnar: bool) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type(value).__name__
        raise fail(field, f"expected a non-empty list of chat messages, got {got}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise fail(f"{field}[{i}]", f"expected a message object, got {type(message).__name__}")
        if columnar:
            message = {k: _drop_nulls(v) for k, v in message.items() if v is not None or k == "content"}
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise fail(f"{field}[{i}].role", f"expected a role string, got {role!r}")
        content = message.get("content")
        if "content" not in message and not message.get("tool_calls"):
            raise fail(f"{field}[{i}].content", "missing (only a message with tool_calls may omit it)")
        if content is not None and not isinstance(content, str | list):
            raise fail(
                f"{field}[{i}].content", f"expected a string or a list of parts, got {type(content).__name__}"
            )
        messages.append(dict(message))
    return messages


def _tools(value: Any, fail: Any, columnar: bool) -> list[dict[str, Any]]:
    if isinstance(value, str):  # tool schemas kept as a JSON string: they survive columnar formats intact
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise fail("tools", f"a string that is not JSON ({e.msg})") from None
    elif columnar:
        value = _drop_nulls(value)
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise fail("tools", "expected a list of tool schemas (objects), or one as a JSON string")
    return value


def _lift_verl_kwargs(row: Row, fail: Any, columnar: bool) -> None:
    """verl's per-row settings of its tools and interaction, kept in ``extra_info``, as the row's
    ``tools_kwargs`` (tool name -> its settings: a tool call's ``ToolContext.tool_kwargs``) and
    ``interaction_kwargs`` (``name`` picks the registered interaction; the interaction reads the
    rest from its row)."""
    extra = row.get("extra_info")
    if not isinstance(extra, dict):
        return
    for key in ("tools_kwargs", "interaction_kwargs"):
        value = extra.get(key)
        if value is None or key in row:
            continue
        value = _drop_nulls(value) if columnar else value
        if not isinstance(value, dict) or (
            key == "tools_kwargs" and not all(isinstance(v, dict) for v in value.values())
        ):
            raise fail(
                f"extra_info.{key}",
                "expected {tool name: {create_kwargs: {...}, ...}}"
                if key == "tools_kwargs"
                else "expected {name: <interaction>, ...}",
            )
        if key == "interaction_kwargs" and not isinstance(value.get("name", ""), str):
            raise fail(
                "extra_info.interaction_kwargs.name", f"expected an interaction's name, got {value['name']!r}"
            )
        row[key] = value


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


# -- synthetic --------------------------------------------------------------------------------
def synthetic_rows(
    task: str, n: int, *, seed: int, split: Split, tool_loop: str = "tool", distinct: bool = True
) -> list[Row]:
    """``n`` problems of a synthetic task as rows, the same for the same arguments.
    ``distinct``: ``make_problems``' distinct problems (a validation set). Else the first ``n``
    the task draws, repeats kept, so the rows follow the task's own distribution: drawing 20,000
    distinct training problems used up the 460 three-letter ``reverse`` words, which made them
    2.4 % of training but 12-20 % of validation (a model that never learned them held out at
    0.8 while its training reward was 0.99). A repeated problem's ``uid`` gets ``#2``, ``#3``...
    so uids stay unique. ``problem`` holds the ``Problem`` for the task's own reward; ``calc``
    rows carry the calculator's schema and pick ``tool_loop`` (a loop that calls tools); the
    others name no loop, so ``agent.default_loop`` picks theirs (``tool`` to talk with
    ``agent.interaction``)."""
    if distinct:
        return [problem_row(p, tool_loop=tool_loop) for p in make_problems(task, n, seed=seed, split=split)]
    seen: collections.Counter[str] = collections.Counter()
    rows = []
    for p in itertools.islice(iter_problems(task, seed=seed, split=split), n):
        seen[p.key] += 1
        uid = f"{p.task}:{p.key}" + (f"#{seen[p.key]}" if seen[p.key] > 1 else "")
        rows.append(problem_row(p, uid=uid, tool_loop=tool_loop))
    return rows


def problem_row(p: Problem, *, uid: str = "", tool_loop: str = "tool") -> Row:
    """The row of one synthetic problem (``uid``: default ``task:key``)."""
    row: Row = {
        "messages": [dict(m) for m in p.messages],
        "ground_truth": p.answer,
        "uid": uid or f"{p.task}:{p.key}",
        "task": p.task,
        "problem": p,
    }
    if p.tools:
        row["tools"] = list(p.tools)
        row["agent_name"] = tool_loop
    return row


# -- sampling ---------------------------------------------------------------------------------
class RowSampler:
    """Seeded epoch-wise shuffling: each epoch visits every row once, in an order that depends
    only on ``(seed, epoch)``, so ``(epoch, position, seed)`` is the whole state and a sampler
    restored from ``state_dict()`` continues with exactly the batches an uninterrupted one gives.

    A batch continues into the next epoch when the current one runs out, unless ``drop_last``:
    then a batch never spans two epochs, and an epoch's last ``len(rows) % n`` rows are skipped.
    ``shuffle=False`` keeps the rows' order (validation). Batches hold shallow copies of the rows.
    """

    def __init__(
        self, rows: Iterable[Row], *, seed: int, shuffle: bool = True, drop_last: bool = False
    ) -> None:
        self.rows = list(rows)
        if not self.rows:
            raise ValueError("RowSampler needs at least one row")
        self.seed, self.shuffle, self.drop_last = int(seed), shuffle, drop_last
        self.epoch = 0
        self.position = 0
        """Rows of the current epoch already handed out."""
        self.size = len(self.rows)
        """Rows the current epoch visits: rows added during it (``add_rows``) join the next one."""
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> list[int]:
        """The row indices of one epoch, in the order they are handed out."""
        order = list(range(self.size))
        if self.shuffle:
            random.Random(f"rlasync.RowSampler/{self.seed}/{epoch}").shuffle(
                order
            )  # str seed: stable everywhere
        return order

    def next_batch(self, n: int) -> list[Row]:
        return [dict(self.rows[index]) for _, index in self.next_uses(n)]

    def next_uses(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` rows as ``(epoch, row index)``: which use of which row each is (what
        ``next_batch`` hands out, as ids: a run's ledger of what it trained)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        if self.drop_last and n > len(self.rows):
            raise ValueError(f"drop_last: a batch of {n} cannot fit in an epoch of {len(self.rows)} rows")
        if self.drop_last and self.position + n > self.size:
            self._next_epoch()
        uses: list[tuple[int, int]] = []
        while len(uses) < n:
            if self.position == self.size:
                self._next_epoch()
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.order(self.epoch), self.epoch
            take = min(n - len(uses), self.size - self.position)
            uses.extend((self.epoch, i) for i in self._order[self.position : self.position + take])
            self.position += take
        return uses

    def _next_epoch(self) -> None:
        self.epoch, self.position, self.size = self.epoch + 1, 0, len(self.rows)

    def add_rows(self, rows: Iterable[Row]) -> None:
        """More rows (a ``data.generator``'s): handed out from the next epoch on."""
        self.rows.extend(rows)

    def state_dict(self) -> dict[str, int]:
        """Plain ints (JSON-safe). ``num_rows`` lets a restore notice that the data changed."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": len(self.rows),
            "size": self.size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (its seed replaces this sampler's)."""
        num_rows = state.get("num_rows", len(self.rows))
        if num_rows != len(self.rows):
            raise ValueError(f"sampler state is for {num_rows} rows, this dataset has {len(self.rows)}")
        epoch, position, size = int(state["epoch"]), int(state["position"]), int(state.get("size", num_rows))
        if epoch < 0 or not 0 <= position <= size <= len(self.rows):
            raise ValueError(
                f"sampler state out of range: epoch {epoch}, position {position} of {size} ({len(self.rows)} rows)"
            )
        self.seed, self.epoch, self.position, self.size = int(state["seed"]), epoch, position, size
        self._order_epoch = -1
