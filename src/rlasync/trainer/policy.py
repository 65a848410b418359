"""The policy trainer: logprobs of a rollout batch under the current policy, and PPO/GRPO steps.

One process, one model (data-parallel ranks over torch.distributed come on top of it). The
training forward uses the batch's ``position_ids`` (real tokens only, what the engine used
when sampling) and the sampling temperature, so at the start of an on-policy step its
logprobs equal the engine's behaviour logprobs and the PPO ratio is 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..agents.batch import RolloutBatch
from ..algorithms import policy_loss
from ..config.train import TrainerConfig


class PolicyTrainer:
    def __init__(self, model: Any, config: TrainerConfig | None = None, *, total_steps: int = 1) -> None:
        self.config = config or TrainerConfig()
        self.model = model.train()
        cfg = self.config
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay
        )
        warmup, total = cfg.warmup_steps, max(total_steps, 1)

        def schedule(step: int) -> float:  # linear warm-up, then cosine down to min_lr_ratio
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule if cfg.cosine else (lambda s: min(1.0, (s + 1) / max(warmup, 1))))
        self.steps = 0

    def logprobs(self, batch: RolloutBatch, temperature: float = 1.0, *, rows: slice | None = None) -> torch.Tensor:
        """``[B, R]`` logprobs of the response tokens under the current policy (with grad)."""
        rows = rows or slice(None)
        prompt_len = batch.prompts.shape[1]
        input_ids = batch.input_ids[rows]
        out = self.model(input_ids=input_ids, attention_mask=batch.attention_mask[rows], position_ids=batch.position_ids[rows], use_cache=False)
        logits = out.logits[:, prompt_len - 1 : -1].float()
        if temperature > 0:
            logits = logits / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, batch.responses[rows].unsqueeze(-1)).squeeze(-1)

    def step(self, batch: RolloutBatch, advantages: torch.Tensor, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimiser step on the batch (gradient accumulated over micro-batches)."""
        cfg = self.config
        mask = batch.response_mask.float()
        size = batch.responses.shape[0]
        # Normalise every micro-batch by the global count, so they add up to the batch's loss.
        if cfg.loss_agg == "token-mean":
            denominator = float(mask.sum().clamp(min=1))
        else:
            denominator = float((mask.sum(-1) > 0).sum().clamp(min=1))
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        micro = cfg.micro_batch_size or size
        for start in range(0, size, micro):
            rows = slice(start, min(size, start + micro))
            new = self.logprobs(batch, temperature, rows=rows)
            loss, metrics = policy_loss(
                new, batch.logprobs[rows], advantages[rows], mask[rows],
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip_c=cfg.dual_clip_c, agg=cfg.loss_agg,
            )  # fmt: skip
            local = mask[rows].sum() if cfg.loss_agg == "token-mean" else (mask[rows].sum(-1) > 0).sum()
            (loss * float(local) / denominator).backward()  # the micro-batch's share of the batch loss
            share = (rows.stop - start) / size
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1
        totals.update(grad_norm=float(grad_norm), lr=float(self.scheduler.get_last_lr()[0]))
        return totals

    def weights(self) -> dict[str, torch.Tensor]:
        """The current parameters by name, detached copies (what engines load)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}
