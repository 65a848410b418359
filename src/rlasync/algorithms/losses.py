"""Policy-gradient losses on token tensors: PPO clip (+ dual clip, clip-higher, decoupled PPO),
loss aggregation, entropy, and KL estimators to a reference policy.

Shapes: ``N`` sequences × ``T`` response positions; ``mask [N, T]`` is 1 on tokens the policy
generated (bool or float). Logprobs are of the sampled token, ``[N, T]``. Metrics come back as
plain detached floats; each is a mean over valid tokens unless its name says ``min``/``max``.
"""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]

LOG_RATIO_BOUND = 20.0  # exp(±20) stays finite in fp32; a ratio beyond it is clipped anyway


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode, *, denominator: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss ``[N, T]`` to a scalar.

    - ``token-mean``: ``sum_{i,t} m l / sum_{i,t} m`` — every token weighs the same (DAPO).
    - ``seq-mean-token-mean``: ``mean_i (sum_t m l / L_i)`` — every sequence weighs the same (GRPO paper).
    - ``seq-mean-token-sum``: ``mean_i sum_t m l`` — sequences weigh by length (Dr. GRPO up to a constant).

    Sequences with no valid token are left out of the sequence means. ``denominator`` replaces
    the normaliser (tokens for ``token-mean``, sequences for the others) so that the losses of
    micro-batches, each divided by the *global* count, add up to the global batch's loss.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1) if denominator is None else denominator
        return (loss_mat * mask).sum() / denom
    lengths = mask.sum(dim=-1)  # [N]
    seq_sum = (loss_mat * mask).sum(dim=-1)  # [N]
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        raise ValueError(
            f"unknown aggregation mode {mode!r}; expected token-mean, seq-mean-token-mean or seq-mean-token-sum"
        )
    valid = (lengths > 0).to(loss_mat.dtype)
    denom = valid.sum().clamp(min=1) if denominator is None else denominator
    return (per_seq * valid).sum() / denom


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg: AggMode = "token-mean",
    proximal_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss (to minimise) and its metrics.

    With ``anchor = proximal_logprobs`` if given, else ``old_logprobs`` (the behaviour policy's):

    - ``r = exp(logprobs - anchor)``
    - ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` — asymmetric ranges allowed
      ("clip-higher", DAPO: ``clip_high > clip_low``);
    - dual clip (Ye et al. 2019), for ``A < 0`` only: ``l = min(l, -A c)`` with ``c = dual_clip_c > 1``,
      which bounds the loss of a token whose ratio has run far above 1;
    - decoupled PPO (AReaL), when ``proximal_logprobs`` is given: ``l *= exp(proximal - old)``, the
      importance weight from the behaviour policy that sampled the token to the proximal policy
      the ratio is clipped against (detached). With ``proximal == old`` this is plain PPO;
    - ``l *= is_weights`` (detached), e.g. truncated IS weights from :mod:`.correction`;
    - ``loss = aggregate(l, mask, agg)``.

    ``advantages`` is ``[N, T]`` or ``[N]`` (broadcast over tokens). Metrics: ``pg_clipfrac``
    (tokens where the clipped term is the active one), ``pg_clipfrac_lower`` (dual clip active),
    ``ppo_kl`` (``mean(anchor - logprobs)``), ``ratio_mean/min/max`` over valid tokens, and
    ``behav_weight_mean`` with decoupled PPO.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    maskf = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype).detach()
    anchor = (old_logprobs if proximal_logprobs is None else proximal_logprobs).detach()

    log_ratio = torch.clamp(logprobs - anchor, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clipfrac = _masked_mean((clipped > unclipped).to(maskf.dtype), maskf)

    metrics: dict[str, float] = {}
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = _masked_mean(
            (negative & (loss_mat > bound)).to(maskf.dtype), maskf
        ).item()
        loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)

    if proximal_logprobs is not None:
        behav = torch.exp(
            torch.clamp(proximal_logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ).detach()
        loss_mat = loss_mat * behav
        metrics["behav_weight_mean"] = _masked_mean(behav, maskf).item()
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach().to(loss_mat.dtype)

    loss = aggregate(loss_mat, maskf, agg)
    valid = maskf > 0
    r = ratio.detach()
    metrics.update(
        pg_loss=loss.detach().item(),
        pg_clipfrac=clipfrac.item(),
        ppo_kl=_masked_mean(-log_ratio.detach(), maskf).item(),
        ratio_mean=_masked_mean(r, maskf).item(),
        ratio_min=r[valid].min().item() if valid.any() else 1.0,
        ratio_max=r[valid].max().item() if valid.any() else 1.0,
    )
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last axis: ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.

    ``[N, T, V] -> [N, T]``; differentiable (an entropy bonus subtracts ``coef * aggregate(H, …)``).
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman, "Approximating KL").

    With ``d = logprobs - ref_logprobs``:

    - ``k1 = d`` — unbiased, can be negative;
    - ``k2 = d^2 / 2`` — biased, >= 0;
    - ``k3`` (alias ``low_var_kl``) ``= exp(-d) + d - 1`` — unbiased, >= 0, low variance; as in verl
      ``-d`` is clamped to ±20 and the result to at most 10.
    """
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        neg = torch.clamp(-d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(neg) - neg - 1.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")
