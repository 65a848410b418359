"""``rlasync eval``: how often a model answers the held-out rows right, sampled ``k`` times
each: pass@1 and pass@k, avg@k and maj@k, on the engines and placement the config trains with.

- **pass@j** (j = 1 and k): the chance that at least one of j answers is right, estimated
  without bias from the k samples of each row (``pass_at``: 1 - C(k-c, j) / C(k, j) with c of
  them right), averaged over the rows. pass@1 is the mean rightness of a single answer.
- **avg@k**: the mean reward of all samples (with 0/1 rewards, pass@1 again; with partial
  credit, the mean credit).
- **maj@k**: a row counts as right when its most frequent answer (``voted_answer``; a tie goes
  to the answer seen first) is right.

An answer is "right" when its reward is at least ``correct`` (1.0). The rows are the run's
held-out rows: ``data.val_files``, ``data.source``'s held-out split, or the synthetic task's
(``train.val_size`` of them).
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from ..config import Config, ConfigError
from ..engines import SamplingParams

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


class EvalResult(msgspec.Struct, kw_only=True):
    """What ``evaluate`` measured (its JSON line)."""

    model: str
    rows: int
    samples: int
    temperature: float
    scores: dict[str, float]
    """``pass@1``, ``pass@k``, ``avg@k``, ``maj@k`` (k the samples per row)."""


def pass_at(n: int, c: int, j: int) -> float:
    """The unbiased estimate of pass@j from ``n`` samples of which ``c`` are right (Chen et
    al., 2021): the chance that j of the n, drawn without replacement, are not all wrong."""
    if not 0 <= c <= n or not 1 <= j <= n:
        raise ValueError(f"pass@{j} of {c} right in {n} samples: needs 0 <= c <= n and 1 <= j <= n")
    return 1.0 - math.comb(n - c, j) / math.comb(n, j)


def voted_answer(text: str) -> str:
    """What a reply votes for in maj@k: its last ``<answer>`` tag, else its last ``\\boxed{}``,
    else its last non-empty line after any thinking; whitespace collapsed."""
    from ..rewards import extract_boxed

    tags = _ANSWER_TAG.findall(text)
    if tags:
        found = tags[-1]
    elif (boxed := extract_boxed(text)) is not None:
        found = boxed
    else:
        lines = [line for line in _THINK.sub("", text).splitlines() if line.strip()]
        found = lines[-1] if lines else ""
    return " ".join(found.split())


def scores(groups: Sequence[Sequence[tuple[str, float]]], *, correct: float = 1.0) -> dict[str, float]:
    """pass@1, pass@k, avg@k and maj@k of rows' samples, each a ``(reply text, reward)``."""
    if not groups or any(len(g) != len(groups[0]) for g in groups) or not groups[0]:
        raise ValueError("scores needs rows with the same positive number of samples each")
    k = len(groups[0])
    right = [[reward >= correct for _, reward in group] for group in groups]
    majority = []
    for group, marks in zip(groups, right):
        votes = collections.Counter(voted_answer(text) for text, _ in group)
        top = max(votes.values())
        winner = next(voted_answer(text) for text, _ in group if votes[voted_answer(text)] == top)
        majority.append(next(mark for (text, _), mark in zip(group, marks) if voted_answer(text) == winner))
    out = {"pass@1": statistics.fmean([pass_at(k, sum(m), 1) for m in right])}
    out[f"pass@{k}"] = statistics.fmean([pass_at(k, sum(m), k) for m in right])
    out[f"avg@{k}"] = statistics.fmean([reward for group in groups for _, reward in group])
    out[f"maj@{k}"] = statistics.fmean([float(m) for m in majority])
    return out


def model_to_evaluate(config: Config, checkpoint: str) -> Path:
    """The model folder: a checkpoint's ``model/`` (``checkpoint_folder``), or with ``checkpoint``
    "" the one the run starts from."""
    from .model_dir import starting_model_dir

    if not checkpoint:
        return starting_model_dir(config)
    folder = checkpoint_folder(config, checkpoint)
    if not (folder / "model" / "config.json").is_file():
        raise ConfigError(f"--checkpoint {folder}: it holds no model/ folder")
    return folder / "model"


def checkpoint_folder(config: Config, checkpoint: str) -> Path:
    """A checkpoint folder, checked against its manifest; ``newest``: the newest sound one in
    ``train.run_dir``. A missing or torn one is a ``ConfigError`` naming it."""
    from ..trainer.checkpoint import CheckpointError, Checkpoints, verify

    if checkpoint == "newest":
        try:
            return Checkpoints(config.train.run_dir, keep=config.train.keep_checkpoints).latest()
        except CheckpointError as exc:
            raise ConfigError(f"--checkpoint newest: {exc}") from None
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ConfigError(
            f"--checkpoint {checkpoint}: no such folder (a checkpoint is runs/<run>/checkpoints/step_N)"
        )
    problem = verify(folder)
    if problem:
        raise ConfigError(f"--checkpoint {checkpoint}: not a sound checkpoint ({problem})")
    return folder


async def evaluate(
    config: Config,
    *,
    checkpoint: str = "",
    samples: int = 4,
    temperature: float | None = None,
    correct: float = 1.0,
) -> EvalResult:
    """Sample ``samples`` answers to each held-out row with the model ``checkpoint`` names
    (``model_to_evaluate``) at ``temperature`` (None: ``train.temperature``) and score them
    (``scores``). The run's parts open in ``<train.run_dir>/eval`` and close again."""
    from .run import Run

    if samples < 1:
        raise ConfigError(f"--samples {samples}: at least 1")
    model = await asyncio.to_thread(model_to_evaluate, config, checkpoint)
    cfg = config.train
    config = msgspec.structs.replace(
        config,
        train=msgspec.structs.replace(cfg, model_dir=str(model), run_dir=str(Path(cfg.run_dir) / "eval")),
    )
    temperature = cfg.temperature if temperature is None else temperature
    run = await Run.open(config)
    try:
        rows = [
            dict(row, uid=f"eval/{i}/{j}") for i, row in enumerate(run.feed.val_rows) for j in range(samples)
        ]
        params = SamplingParams(
            temperature=temperature, max_new_tokens=cfg.max_new_tokens, ignore_eos=cfg.ignore_eos
        )
        trajectories = await run.rollouts.trajectories(rows, params, group=samples)
    finally:
        await run.close()
    groups = [
        [(_reply(t), float(t.reward)) for t in trajectories[i : i + samples]]
        for i in range(0, len(trajectories), samples)
    ]
    return EvalResult(
        model=str(model),
        rows=len(groups),
        samples=samples,
        temperature=temperature,
        scores=scores(groups, correct=correct),
    )


def _reply(trajectory: Any) -> str:
    answers = [m for m in trajectory.messages if m.get("role") == "assistant"]
    return str(answers[-1].get("content") or "") if answers else ""
