"""Where a run's prompts come from (``data.*``; verl's ``data.*`` names where they exist)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class DataConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Training and validation rows (``data.*``). Without files, the rows are problems of the
    synthetic ``train.task``, scored by the task's own reward."""

    train_files: list[str] = []
    """Training rows: ``.jsonl`` or ``.parquet`` files, or folders written by ``datasets``'
    ``save_to_disk`` (see ``rlasync.data.load_rows``); all of them, concatenated."""
    val_files: list[str] = []
    """Held-out rows scored at each validation (``train.val_size`` of them at most; greedy unless
    ``train.val_temperature``)."""
    prompt_key: str = "prompt"
    """The column holding the prompt (a string, or chat messages); rows with ``messages`` keep them."""
    answer_key: str | None = None
    """The column the reward compares against (renamed ``ground_truth``); None: rows already
    have ``ground_truth``, or the reward needs none."""
    system_prompt: str | None = None
    """Put first in every prompt that has no system message."""
    reward: str | dict[str, Any] = "exact_match"
    """The reward of file rows, by name from ``rlasync.rewards`` (``exact_match``,
    ``exact_numeric``, ``boxed_math``, ``math_verify``, ``tool_format``, ``verl_default`` (verl's
    scorer of each row's ``data_source``), or one you register), or one built from options:
    ``{llm_judge: {url: http://host:8000/v1, verdict: score, timeout_s: 20}}`` (an LLM judge,
    ``rlasync.rewards.judge``); ``custom_reward_function`` replaces it with a verl reward function."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (seeded by ``train.seed``; resumable)."""
    sampler: str | dict[str, Any] = "uniform"
    """Which rows each step trains on: ``uniform`` (every row once per epoch), ``pass_rate`` (a
    curriculum: rows the policy always or never solves are mostly skipped; options ``low``,
    ``high``, ``revisit``, ``retry_unsolved``, ``pass_reward``), one registered with ``rlasync.data.register_sampler``,
    or a class by import path (``my_package.curriculum:HardFirst``). Options: ``{name: pass_rate, revisit: 0.2}``.
    Its state is saved in checkpoints (``rlasync.data.samplers``)."""
    generator: str | dict[str, Any] = ""
    """Rows added during the run (verl's dynamic datasets): after each step the generator hears
    the trained rows' rewards and may add rows, which the sampler hands out from its next epoch.
    ``rising_difficulty`` (the ``reverse`` task: words one letter longer each time the pass rate
    over ``window`` rows reaches ``threshold``; options ``batch``, ``start_length``,
    ``max_length``), or one registered with ``rlasync.data.register_generator``. The rows it made
    and its state are saved in checkpoints. "": none."""
    source: str | dict[str, Any] = ""
    """An environment the rows come from, which also scores them (``rlasync.envs``), instead of
    files: ``{reasoning_gym: {task: chain_sum, size: 2000}}``, or one registered with
    ``rlasync.envs.register_environment``. Its options go to it; ``seed`` defaults to
    ``train.seed``. "": the run's own, ``files`` (``train_files``, scored by ``reward`` or
    ``custom_reward_function``) or ``synthetic`` (``train.task``: ``{synthetic: {task: calc}}``)."""
    synthetic_train_size: PositiveInt = 20000
    """Training rows drawn from the synthetic task when there are no files: the first this many
    problems its training split draws, repeats kept, so training sees every kind of problem as
    often as the task (and its held-out split) does."""


class CustomRewardFunctionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A verl reward function, named as verl names it (``custom_reward_function.*``): the
    rows' reward instead of ``data.reward``. ``compute_score(data_source, solution_str,
    ground_truth, extra_info, **reward_kwargs)`` returns a score, or a dict with ``score`` and
    other values (kept as the trajectory's reward metrics); sync or async."""

    path: str = ""
    """The Python file defining it ("": none). On other hosts it must lie at the same path."""
    name: str = "compute_score"
    """The function's name in that file."""
    reward_kwargs: dict[str, Any] = {}
    """Keyword arguments passed on every call."""
