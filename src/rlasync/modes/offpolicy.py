"""One trainer step of an asynchronous schedule: its mini-batches, the off-policy correction
``async_training.*`` asks for, and how stale the data was.

A step takes whole samples (prompt groups). They are trained on in mini-batches of
``train.prompts_per_step`` samples, one optimiser update each (``require_batches`` of them).
With ``use_rollout_log_probs`` (the default) PPO's ratio is taken against the engine's
behaviour logprobs; otherwise the trainer first recomputes the logprobs under its current
parameters (the proximal policy) and the loss is decoupled PPO. ``rollout_is`` adds truncated
importance weights from the behaviour to the proximal policy; ``rollout_rs`` leaves tokens (or
samples) whose ratio between the two is out of bounds out of the loss.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import torch

from ..algorithms import offpolicy_metrics, rejection_mask, tis_weights
from ..compose.run import Run, off_loop
from ..metrics import Staleness, StepRecord, Weights, reduce_metrics


async def train_step(run: Run, step: int, samples: list[list[Any]], version: int) -> StepRecord:
    """Train on ``samples`` (each a group of trajectories) at ``version``: step ``step``'s record."""
    config, acfg = run.config, run.config.async_training
    temperature = config.train.temperature
    per_update = config.train.prompts_per_step
    parts: list[tuple[float, dict[str, float]]] = []
    rewards, tokens, longest = [], 0, 0
    for start in range(0, len(samples), per_update):
        trajectories = [t for sample in samples[start : start + per_update] for t in sample]
        batch, train_batch = await run.train_batch(trajectories)
        extra: dict[str, float] = {}
        if not acfg.use_rollout_log_probs or acfg.rollout_is != "none" or acfg.rollout_rs != "none":
            proximal = await run.trainer.compute_logprobs(train_batch, temperature=temperature)
            train_batch, extra = _corrected(run, train_batch, proximal)
        metrics = await run.trainer.step(train_batch, temperature=temperature)
        parts.append((float(metrics.get("tokens", 0.0)), {**metrics, **extra}))
        rewards.append(batch.rewards)
        tokens += int(batch.response_mask.sum())
        longest = max(longest, int(batch.response_mask.sum(-1).max()))
    merged = reduce_metrics(parts)
    return StepRecord(
        step=step,
        train={k: v for k, v in merged.items() if k != "tokens"},
        reward=float(torch.cat(rewards).mean()),
        response_tokens=tokens,
        response_len_max=longest,
        updates=len(parts),
        staleness=await off_loop(Staleness.of, samples, version),
    )


def _corrected(run: Run, train_batch: Any, proximal: torch.Tensor) -> tuple[Any, dict[str, float]]:
    """``train_batch`` with the corrections ``async_training.*`` asks for, against the
    ``proximal`` logprobs (the trainer's current parameters), and their ``offpolicy/*`` metrics:
    the proximal policy for decoupled PPO, truncated importance weights (``rollout_is``), and
    rejection of tokens or samples out of bounds (``rollout_rs``)."""
    acfg = run.config.async_training
    logprobs, mask = train_batch.logprobs, train_batch.response_mask
    extra = {f"offpolicy/{k}": v for k, v in offpolicy_metrics(proximal, logprobs, mask).items()}
    if not acfg.use_rollout_log_probs:
        train_batch = msgspec.structs.replace(train_batch, proximal_logprobs=proximal)
    corrections = (  # (level, the field it sets, how): importance weights, then rejection
        (acfg.rollout_is, "is_weights", functools.partial(tis_weights, threshold=acfg.rollout_is_threshold)),
        (acfg.rollout_rs, "response_mask", functools.partial(rejection_mask, high=acfg.rollout_rs_threshold)),
    )
    for level, field, correct in corrections:
        if level != "none":
            value, metrics = correct(proximal, logprobs, mask, level=level)
            train_batch = msgspec.structs.replace(train_batch, **{field: value})
            extra.update({f"offpolicy/{k}": v for k, v in metrics.items()})
    return train_batch, extra


def weights_of(report: Any, **timings: float) -> Weights:
    """A step's ``weights/*`` from the sync's report: its seconds (``timings``: the schedule's
    names for them) and what the version cost the engines."""
    served = report.engines.values()
    expected = report.version if report.expected is None else report.expected
    return Weights(
        **{"relay_s": report.relay_s, **timings},
        engine_idle_s=report.engine_idle_s,
        reprefill_tokens=report.reprefill_tokens,
        all_paused=int(report.all_paused),
        live_versions=len(set(served)),
        engines_behind=sum(1 for v in served if v < expected),
    )
