"""Settings of the asynchronous schedules (``async_training.*``), under verl's names."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class AsyncTrainingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How generation and training overlap in ``train.mode=one_step_off`` and ``fully_async``
    (verl's ``async_training.*``; the sync mode ignores them)."""

    staleness_threshold: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """How far ahead of the trainer generation may run, in batches per weight version (verl's
    meaning): up to ``(1 + staleness_threshold) * trigger_parameter_sync_step`` steps' samples
    are admitted and not yet trained on. The bound is exact and per token: no trained token
    comes from a version more than ``ceil(staleness_threshold)`` below the one being trained
    (verl's is only an aggregate). 0 with ``trigger_parameter_sync_step=1`` is on-policy."""
    trigger_parameter_sync_step: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Trainer steps between two weight syncs (each sync is one new version)."""
    require_batches: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Mini-batches of ``train.prompts_per_step`` samples one trainer step takes from the
    queue; the step makes one optimiser update per mini-batch."""
    partial_rollout: bool = True
    """At a weight sync, interrupt in-flight generations (engine ``pause("abort")``), keep
    their tokens and per-token versions, and continue them under the new weights after the
    sync. False: the sync first waits for in-flight model turns to finish (``pause("wait")``).
    Either way it never waits for a tool call: a running tool goes on, and the trajectory's
    next turn queues in the engine until the sync is done."""
    drain_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    """With ``partial_rollout`` false, how long a weight sync waits for in-flight model turns
    to finish; those still running then are cut and continued under the new weights, as
    ``partial_rollout`` does. The sync itself has ``weights.timeout_s``."""
    use_rollout_log_probs: bool = True
    """PPO's old logprobs are the engine's (behaviour) logprobs. False: the trainer recomputes
    them at the start of each step (the proximal policy) and the loss is AReaL's decoupled
    PPO, weighted by proximal / behaviour."""
    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling from the behaviour to the proximal policy (needs the
    trainer's recomputed logprobs: costs one forward pass per step)."""
    rollout_is_threshold: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    """The truncation ``C`` of the IS weights (``min(rho, C)``)."""
    rollout_rs: Literal["none", "token", "sequence"] = "none"
    """Rejection sampling (verl's ``rollout_rs``): tokens whose ratio proximal / behaviour leaves
    ``[1 / rollout_rs_threshold, rollout_rs_threshold]`` are left out of the loss (``token``),
    or whole samples whose geometric-mean ratio does (``sequence``). Needs the trainer's
    recomputed logprobs (one forward pass per step); ``offpolicy/rejected_*`` count them."""
    rollout_rs_threshold: Annotated[float, msgspec.Meta(gt=1)] = 2.0
    """The upper ratio bound of ``rollout_rs``; the lower one is its inverse."""
    max_concurrent_samples: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Samples (prompt groups) generating at once; 0: as many as the staleness bound admits."""
