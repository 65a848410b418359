"""Off-policy correction between the rollout (behaviour) policy ``mu`` and the training policy ``pi``.

The engine that sampled a token reports its logprob ``log mu``; the trainer recomputes
``log pi`` for the same token. They differ because of staleness (async modes train on samples
from older weights) and because engine and trainer compute differently (kernels, precision).
With the per-token ratio ``rho_t = pi/mu = exp(log pi_t - log mu_t)``:

- :func:`tis_weights` — truncated importance sampling (TIS): ``min(rho_t, C)`` per token, or
  ``min(prod_t rho_t, C)`` per sequence; multiply the per-token loss by them.
- :func:`rejection_mask` — drop tokens (or whole sequences) whose ratio leaves ``[low, high]``.
- :func:`offpolicy_metrics` — how far apart the two policies are.

Shapes: ``[N, T]`` logprobs of the sampled tokens and ``mask [N, T]`` (bool or float). Weights
and masks are detached; metrics are plain floats.
"""

from __future__ import annotations

from typing import Literal

import torch

Level = Literal["token", "sequence"]

LOG_RATIO_BOUND = 20.0


def _log_ratio(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    return (train_logprobs - rollout_logprobs).detach()


def _check_level(level: str) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")


def tis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Level = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights ``[N, T]`` (0 on padding) and their metrics.

    - token: ``w_t = min(rho_t, C)``;
    - sequence: ``w_i = min(exp(sum_t m_t log rho_t), C)``, the same for every token of sequence i;

    with ``C = threshold`` and log-ratios clamped to ±20 before ``exp``. Metrics: ``tis_mean``
    (mean weight over valid tokens) and ``tis_clip_frac`` (fraction of valid tokens, or of
    sequences with a valid token, whose weight was truncated).
    """
    _check_level(level)
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    maskf = mask.to(train_logprobs.dtype)
    log_ratio = _log_ratio(train_logprobs, rollout_logprobs)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        units, unit_mask = raw, maskf
    else:
        seq_log = (log_ratio * maskf).sum(dim=-1)  # [N]
        seq_raw = torch.exp(seq_log.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        raw = seq_raw.unsqueeze(-1).expand_as(log_ratio)
        units, unit_mask = seq_raw, (maskf.sum(dim=-1) > 0).to(maskf.dtype)
    weights = torch.clamp(raw, max=threshold) * maskf
    metrics = {
        "tis_mean": ((weights * maskf).sum() / maskf.sum().clamp(min=1)).item(),
        "tis_clip_frac": (
            ((units > threshold).to(maskf.dtype) * unit_mask).sum() / unit_mask.sum().clamp(min=1)
        ).item(),
    }
    return weights, metrics


def rejection_mask(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Level = "token",
    low: float | None = None,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mask with rejected tokens set to 0, same dtype as ``mask``, and the rejection rates.

    - token: keep token t iff ``low <= rho_t <= high``;
    - sequence: keep all of sequence i iff ``low <= exp(mean_t log rho_t) <= high`` — the
      geometric-mean ratio, which unlike the product does not drift with length (verl's
      ``seq_mean_k1``).

    ``low`` defaults to ``1 / high``. Metrics: ``rejected_token_frac`` (of valid tokens) and
    ``rejected_seq_frac`` (of sequences with a valid token, those that lost at least one token).
    """
    _check_level(level)
    low = 1.0 / high if low is None else low
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got low={low}, high={high}")
    maskf = mask.to(train_logprobs.dtype)
    log_ratio = _log_ratio(train_logprobs, rollout_logprobs)
    lo, hi = (
        torch.log(torch.tensor(low, dtype=log_ratio.dtype)),
        torch.log(torch.tensor(high, dtype=log_ratio.dtype)),
    )
    if level == "token":
        keep = (log_ratio >= lo) & (log_ratio <= hi)
    else:
        lengths = maskf.sum(dim=-1)
        seq_mean = (log_ratio * maskf).sum(dim=-1) / lengths.clamp(min=1)
        keep = ((seq_mean >= lo) & (seq_mean <= hi)).unsqueeze(-1).expand_as(log_ratio)
    valid = maskf > 0
    kept = valid & keep
    dropped = valid & ~keep
    has_tokens = valid.any(dim=-1)
    metrics = {
        "rejected_token_frac": (dropped.sum() / valid.sum().clamp(min=1)).item(),
        "rejected_seq_frac": (
            (dropped.any(dim=-1) & has_tokens).sum() / has_tokens.sum().clamp(min=1)
        ).item(),
    }
    return kept.to(mask.dtype), metrics


def offpolicy_metrics(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout policy ``mu`` is from the training policy ``pi`` on this batch.

    - ``ratio_mean`` / ``ratio_min`` / ``ratio_max``: of ``rho_t`` over valid tokens;
    - ``kl_k1 = mean_t(log mu_t - log pi_t)`` and ``kl_k3 = mean_t(rho_t - log rho_t - 1)``: two
      estimates of ``KL(mu || pi)`` from tokens sampled by ``mu`` (k3 is >= 0 and low-variance);
    - ``training_ppl`` / ``rollout_ppl``: ``mean_i exp(-mean_t log p_t)``, the batch mean of
      per-sequence perplexities under each policy (sequences with no valid token left out).
    """
    maskf = mask.to(train_logprobs.dtype)
    train, rollout = train_logprobs.detach(), rollout_logprobs.detach()
    log_ratio = (train - rollout).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    n_tokens = maskf.sum().clamp(min=1)
    valid = maskf > 0
    lengths = maskf.sum(dim=-1)
    has_tokens = lengths > 0
    n_seqs = has_tokens.sum().clamp(min=1)

    def ppl(logprobs: torch.Tensor) -> float:
        per_seq = torch.exp(-(logprobs * maskf).sum(dim=-1) / lengths.clamp(min=1))
        return (per_seq * has_tokens).sum().div(n_seqs).item()

    return {
        "ratio_mean": ((ratio * maskf).sum() / n_tokens).item(),
        "ratio_min": ratio[valid].min().item() if valid.any() else 1.0,
        "ratio_max": ratio[valid].max().item() if valid.any() else 1.0,
        "kl_k1": ((-log_ratio * maskf).sum() / n_tokens).item(),
        "kl_k3": (((ratio - log_ratio - 1.0) * maskf).sum() / n_tokens).item(),
        "training_ppl": ppl(train),
        "rollout_ppl": ppl(rollout),
    }
