"""RL algorithms as pure tensor functions: advantages, policy losses, off-policy correction,
reward shaping.

No actors, no I/O, no torch.distributed: the trainer calls these on local tensors. Every
function documents its formula and is tested against hand-computed values
(``tests/unit/test_algorithms.py``). Metrics come back as ``dict[str, float]``.
"""

from .advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from .correction import offpolicy_metrics, rejection_mask, tis_weights
from .losses import aggregate, entropy_from_logits, kl_penalty, policy_loss
from .shaping import overlong_penalty

__all__ = [
    "aggregate",
    "broadcast_to_tokens",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "offpolicy_metrics",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_baseline_advantages",
    "rejection_mask",
    "rloo_advantages",
    "tis_weights",
]
