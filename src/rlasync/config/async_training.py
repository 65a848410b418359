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
    interrupt: Literal["keep", "abort", "drain"] | None = None
    """What a weight version does to the model turns an engine is generating when it takes it
    (each engine takes it at its own decode step while the others go on; never all at once):

    - ``keep`` (the default): they go on across the swap with their KV cache; their later
      tokens carry the new version, the earlier ones the old (trained with their own versions,
      under the staleness bound). The torch engine and the simulator swap between two decode
      steps with no pause; vLLM freezes its running requests (``pause("keep")``, cache kept)
      for the load; SGLang's adapter cannot yet, and takes ``abort``.
    - ``abort``: they are cut, keep their tokens, and continue under the new weights once
      re-submitted: each must be prefilled again (``weights/reprefill_tokens``).
    - ``drain``: the engine admits nothing new until they finish (``drain_timeout_s``), then swaps.

    Unset: ``keep``, or ``drain`` where ``partial_rollout`` is false. A running tool call is
    never waited for."""
    commit: Literal["each", "together"] = "each"
    """``each``: engines stage a version while they decode and take it at their own step, half of
    them at a time. ``together``: the old global pause, kept for comparison
    (``benchmarks/pause_bench.py``): every engine stops (as ``interrupt`` says) for the whole
    transfer and resumes together."""
    partial_rollout: bool = True
    """verl's switch: false (turns are not continued across versions) means ``interrupt: drain``
    unless ``interrupt`` is set."""
    drain_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    """With ``interrupt: drain``, how long an engine waits for its running model turns to finish
    before it takes a version; those still running then are cut (as ``abort``). The transfer
    itself has ``weights.timeout_s``."""
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

    @property
    def interruption(self) -> Literal["keep", "abort", "drain"]:
        """``interrupt`` as it applies: ``keep``, or ``drain`` where ``partial_rollout`` is false."""
        if self.interrupt is not None:
            return self.interrupt
        return "keep" if self.partial_rollout else "drain"
