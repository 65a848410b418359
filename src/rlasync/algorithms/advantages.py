"""Outcome advantages: one scalar reward per sequence in, one scalar advantage per sequence out.

Sequences that answer the same prompt form a *group*, given either as ``group_ids [N]`` (any
integer labels, not necessarily contiguous) or as an ``int`` group size G (then the batch is laid
out as consecutive groups: ids ``0,0,…,0,1,1,…``). A group of one has no baseline to compare
against, so its advantage is 0 in every estimator here (verl instead keeps the raw reward for
GRPO/REINFORCE++; we prefer "no signal" to "unbaselined signal").

All functions are pure and gradient-free (advantages are constants of the loss). Use
:func:`broadcast_to_tokens` to turn ``[N]`` advantages into the ``[N, T]`` tensor the policy loss
takes.
"""

from __future__ import annotations

import torch

Groups = torch.Tensor | int


def _group_index(groups: Groups, n: int, device: torch.device) -> torch.Tensor:
    """Dense group index ``[N]`` in ``0..num_groups-1`` from labels or a group size."""
    if isinstance(groups, int):
        if groups <= 0 or n % groups != 0:
            raise ValueError(f"group_size={groups} must be positive and divide the batch size {n}")
        return torch.arange(n, device=device) // groups
    if groups.shape != (n,):
        raise ValueError(f"group_ids must have shape [{n}], got {list(groups.shape)}")
    return torch.unique(groups.to(device), return_inverse=True)[1]


def _group_mean(rewards: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean ``[N]`` and group size ``[N]`` (as float)."""
    num_groups = int(idx.max().item()) + 1 if idx.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, idx, torch.ones_like(rewards)
    )
    total = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, idx, rewards)
    return (total / count)[idx], count[idx]


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor, groups: Groups, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-normalised advantages ``[N]``.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``std_g`` the unbiased (Bessel, n-1) standard
    deviation of the group's rewards, as ``torch.std`` and verl compute it; with
    ``std_normalize=False`` (Dr. GRPO) ``A_i = r_i - mean_g``. A group whose rewards are all equal
    gets advantage 0, and so does a group of one.
    """
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    idx = _group_index(groups, rewards.shape[0], rewards.device)
    mean, count = _group_mean(rewards, idx)
    centered = rewards - mean
    if not std_normalize:
        return centered
    num_groups = int(idx.max().item()) + 1 if idx.numel() else 0
    sq = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, idx, centered**2)
    var = sq[idx] / (count - 1).clamp(min=1)  # a group of one: 0 / 1, no NaN
    return centered / (var.sqrt() + eps)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """REINFORCE leave-one-out advantages ``[N]``.

    ``A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g)``;
    0 for a group of one.
    """
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    idx = _group_index(groups, rewards.shape[0], rewards.device)
    mean, count = _group_mean(rewards, idx)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return scale * (rewards - mean)


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, groups: Groups, *, mask: torch.Tensor | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++-baseline advantages ``[N]``: group-mean baseline, then whitening over the batch.

    ``b_i = r_i - mean_g``, then ``A_i = (b_i - mu) / sqrt(var + eps)`` where ``mu`` and ``var``
    are the mean and unbiased (Bessel) variance of ``b`` over the batch. verl whitens the
    token-level tensor, so each sequence counts once per valid token: pass ``mask [N, T]`` to get
    exactly that (weights ``L_i = sum_t mask[i, t]``, ``var = sum L_i (b_i-mu)^2 / (sum L_i - 1)``).
    Without ``mask`` every sequence counts once.
    """
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    idx = _group_index(groups, rewards.shape[0], rewards.device)
    mean, _ = _group_mean(rewards, idx)
    b = rewards - mean
    w = torch.ones_like(b) if mask is None else mask.to(b.dtype).sum(dim=-1)
    total = w.sum()
    mu = (w * b).sum() / total.clamp(min=1)
    var = (w * (b - mu) ** 2).sum() / (total - 1).clamp(min=1)
    return (b - mu) * torch.rsqrt(var + eps)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages ``[N]`` → per-token ``[N, T]``: ``A[i, t] = A_i * mask[i, t]``."""
    return advantages.unsqueeze(-1) * mask.to(advantages.dtype)
