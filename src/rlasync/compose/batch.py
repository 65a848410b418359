"""Training batches from rolled-out trajectories: whole groups, collated, with group-relative
advantages (``train.advantage``) of the trained reward (the raw reward, less the overlong
penalty of ``train.overlong_buffer``). A batch of nothing but failed rewards early in the run
stops it (``train.fail_on_reward_errors``): the reward is broken, not the policy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import torch

from ..algorithms import grpo_advantages, overlong_penalty, reinforce_pp_baseline_advantages, rloo_advantages
from ..config import Config

if TYPE_CHECKING:
    from ..agents import RolloutBatch
    from ..trainer import TrainBatch


def group_advantages(config: Config, rewards: torch.Tensor) -> torch.Tensor:
    group = config.train.group_size
    if config.train.advantage == "rloo":
        return rloo_advantages(rewards, group)
    if config.train.advantage == "reinforce_pp":
        return reinforce_pp_baseline_advantages(rewards, group)
    return grpo_advantages(rewards, group, std_normalize=config.train.std_normalize)


def with_samples(trajectories: list[Any], advantages: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
    """Each trajectory followed by its further samples (``Trajectory.samples``), and each
    sample's advantage: its trajectory's (they share its reward, so its place in its group)."""
    flat = [s for t in trajectories for s in (t, *t.samples)]
    owner = torch.tensor([i for i, t in enumerate(trajectories) for _ in range(1 + len(t.samples))])
    return flat, advantages[owner]


class Batches:
    """Makes a run's training batches, and counts what they held: the failed rewards over the
    run (``reward/errors``) and the batches made."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reward_errors = 0  # trajectories whose reward failed, over the run (reward/errors)
        self.made = 0  # training batches made

    def make(self, trajectories: list[Any], pad: int) -> tuple[RolloutBatch, TrainBatch, list[float]]:
        """``(RolloutBatch, TrainBatch, overlong penalties)`` of whole groups (``pad``: the
        tokenizer's pad id); the rollout batch's rewards stay the raw ones (reported)."""
        from ..agents import collate
        from ..trainer import TrainBatch

        self._count_reward_errors(trajectories)
        batch = collate(trajectories, pad)
        rewards = batch.rewards
        penalties: list[float] = []
        if self.config.train.overlong_buffer:  # the trained reward; batch.rewards (reported) stays raw
            penalty = overlong_penalty(
                torch.tensor([len(t.response_ids) for t in trajectories]),
                limit=self.config.agent.response_length,
                buffer=self.config.train.overlong_buffer,
                penalty=self.config.train.overlong_penalty,
            )
            penalties = penalty.tolist()
            rewards = rewards + penalty.to(rewards.dtype)
        advantages = group_advantages(self.config, rewards)
        if any(t.samples for t in trajectories):  # an openai agent's further samples
            flat, advantages = with_samples(trajectories, advantages)
            # Tokens and lengths count every sample; the reported reward stays one per trajectory.
            batch = msgspec.structs.replace(collate(flat, pad), rewards=batch.rewards)
        return batch, TrainBatch.from_rollout(batch, advantages), penalties

    def _count_reward_errors(self, trajectories: list[Any]) -> None:
        """Failed rewards, counted (``reward/errors``); a batch of nothing but failed rewards
        within the first ``train.fail_on_reward_errors`` batches stops the run."""
        from ..rewards import RewardError

        failed = [t.metrics.reward_error for t in trajectories if t.metrics.reward_error]
        self.reward_errors += len(failed)
        self.made += 1
        limit = self.config.train.fail_on_reward_errors
        if failed and len(failed) == len(trajectories) and self.made <= limit:
            raise RewardError(
                f"every reward of training batch {self.made} failed ({len(failed)} trajectories), e.g. {failed[0]}; "
                "fix the reward (train.task, data.reward or the reward function), or set train.fail_on_reward_errors=0 to train on"
            )
