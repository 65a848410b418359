"""Training the policy on rollout batches."""

from .policy import PolicyTrainer

__all__ = ["PolicyTrainer"]
