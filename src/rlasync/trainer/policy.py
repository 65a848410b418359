"""The policy trainer of one rank: logprobs of a batch under the current policy, and PPO/GRPO steps.

The training forward uses the batch's ``position_ids`` (real tokens only, what the engine used
when sampling) and the sampling temperature, so at the start of an on-policy step its
logprobs equal the engine's behaviour logprobs and the PPO ratio is 1.

Data parallel: when torch.distributed is initialised with more than one rank, each rank steps
on its shard of the batch with the loss normalised by the *whole* batch's denominator, and the
gradients are summed across ranks (bucketed all-reduce) before clipping: every rank then takes
the same optimiser step, the one a single rank takes on the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..algorithms import aggregate, entropy_from_logits, kl_penalty, policy_loss
from ..config.train import TrainerConfig
from . import lora
from .activations import enable_checkpointing, recompute_gated_activations, token_logprobs
from .packing import packed_logits
from .state import owned, read_safetensors, whole_state
from .types import TrainBatch, micro_plan, reduce_metrics

BUCKET_BYTES = 32 << 20  # gradients are all-reduced in buckets of about this size


class PolicyTrainer:
    def __init__(self, model: Any, config: TrainerConfig | None = None, *, total_steps: int = 1) -> None:
        self.config = config or TrainerConfig()
        self.model = model.train()
        self.device = next(model.parameters()).device
        cfg = self.config
        # bf16 autocast on GPU (weights and AdamW state stay float32); CPU runs float32.
        self.autocast = self.device.type == "cuda" and cfg.autocast_bf16
        # The KL penalty's reference: a frozen copy of the policy as it starts (the warm-start or
        # the SFT model), kept (whole, on every rank) only when the penalty is on. With LoRA none
        # is copied: the model with its adapters switched off is that policy (B starts at zero).
        self.keeps_reference = cfg.kl_coef > 0
        copied = self.keeps_reference and not cfg.lora.rank
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if copied else None
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
        if cfg.recompute_mlp_activation:  # before LoRA and sharding wrap the MLPs' parts
            recompute_gated_activations(model)
        if cfg.lora.rank:  # the base frozen: only the adapters train (rlasync.trainer.lora)
            model = self.model = lora.wrap(model, cfg.lora).train()
        self.sharded = cfg.strategy == "fsdp2" and _world_size() > 1
        if self.sharded:
            _fully_shard(model, self.device)
        trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
            if cfg.optimizer == "sgd"
            # Fused: one kernel over every parameter instead of a dozen small ops per parameter
            # (0.8 ms against 3.0 for the nano model's step on a CPU core; the same update up to
            # rounding). Sharded (DTensor) parameters keep torch's default.
            else torch.optim.AdamW(
                trained,
                lr=cfg.lr,
                betas=(cfg.beta1, cfg.beta2),
                weight_decay=cfg.weight_decay,
                fused=None if self.sharded else True,
            )
        )
        warmup, total = cfg.warmup_steps, max(total_steps, 1)

        def schedule(step: int) -> float:  # linear warm-up, then cosine down to min_lr_ratio (or flat)
            if step < warmup:
                return (step + 1) / warmup
            if not cfg.cosine:
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.steps = 0

    def _forward_context(self) -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _logits(self, model: Any, part: TrainBatch, temperature: float) -> torch.Tensor:
        """``[B, R, V]`` float32 logits that predict the response tokens (scaled by the temperature)."""
        response_len = part.responses.shape[1]
        if self.config.packing:
            with self._forward_context():
                return _tempered(packed_logits(model, part), temperature)
        with self._forward_context():
            # Only the positions that predict a response token go through the LM head (and its
            # backward): the prompt's would be computed and thrown away.
            out = model(
                input_ids=part.input_ids,
                attention_mask=part.attention_mask,
                position_ids=part.position_ids,
                use_cache=False,
                logits_to_keep=response_len + 1,
            )
        return _tempered(out.logits[:, :-1], temperature)

    def logprobs(
        self, batch: TrainBatch, temperature: float = 1.0, *, rows: slice | None = None
    ) -> torch.Tensor:
        """``[B, R]`` logprobs of the response tokens under the current policy (with grad)."""
        part = batch.rows(rows or slice(None)).to(self.device)
        return token_logprobs(self._logits(self.model, part, temperature), part.responses)

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
        """``[B, R]`` logprobs under the frozen reference policy (needs ``trainer.kl_coef > 0``)."""
        if not self.keeps_reference:
            raise RuntimeError("no reference policy: set trainer.kl_coef > 0 to keep one")
        micro = self.config.micro_batch_size or max(batch.size, 1)
        parts = []
        for start in range(0, batch.size, micro):
            part = batch.rows(slice(start, start + micro)).to(self.device)
            parts.append(token_logprobs(self._reference_logits(part, temperature), part.responses).cpu())
        return torch.cat(parts) if parts else torch.zeros_like(batch.logprobs, dtype=torch.float32)

    def _reference_logits(self, part: TrainBatch, temperature: float) -> torch.Tensor:
        """Logits under the frozen reference: its copy, or with LoRA the model's base alone."""
        if self.reference is not None:
            return self._logits(self.reference, part, temperature)
        with self.model.disable_adapter():
            return self._logits(self.model, part, temperature)

    def _plan(self, batch: TrainBatch, count: int | None) -> list[tuple[Any, bool]]:
        """The micro-batches (row slices or index tensors, see ``micro_plan``), each with whether
        it is real. Sharded (FSDP2), every rank must run as many forwards as the others (each
        gathers parameters collectively): a rank with fewer repeats its last micro-batch as a
        zero-weight filler up to ``count``."""
        cfg = self.config
        plan: list[tuple[Any, bool]] = [
            (rows, True) for rows in micro_plan(batch, cfg.micro_batch_size, cfg.micro_batch_tokens)
        ]
        if self.sharded and count is not None and len(plan) < count:
            if not plan:
                raise ValueError(
                    "with trainer.strategy=fsdp2 every rank needs at least one row: give a batch of at least trainer.world_size sequences"
                )
            plan += [(plan[-1][0], False)] * (count - len(plan))
        return plan

    def _part(self, batch: TrainBatch, rows: Any) -> TrainBatch:
        part = batch.rows(rows)
        return (part.trim() if self.config.micro_batch_tokens else part).to(self.device)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, temperature: float = 1.0, *, micro_batches: int | None = None
    ) -> torch.Tensor:
        """``[B, R]`` logprobs without grad, in micro-batches (old/proximal logprobs)."""
        out = torch.zeros(batch.logprobs.shape, dtype=torch.float32)
        for rows, real in self._plan(batch, micro_batches):
            part = self._part(batch, rows)
            logprobs = token_logprobs(
                self._logits(self.model, part, temperature), part.responses
            )  # fillers too: the forward is collective
            if real:
                out[rows, : logprobs.shape[1]] = logprobs.cpu()
        return out

    def step(
        self,
        batch: TrainBatch,
        *,
        temperature: float = 1.0,
        denominator: float | None = None,
        micro_batches: int | None = None,
    ) -> dict[str, float]:
        """One optimiser step on ``batch`` (gradients accumulated over micro-batches, summed
        over ranks). ``denominator``: the whole batch's (all ranks'), see
        ``TrainBatch.loss_denominator``; omitted, this batch is the whole batch.
        ``micro_batches``: the most any rank runs (FSDP2 ranks must run as many).

        Returns this rank's metrics (token-weighted over its micro-batches) with ``tokens``,
        plus ``grad_norm`` and ``lr`` (the same on every rank)."""
        cfg = self.config
        denominator = denominator or batch.loss_denominator(cfg.loss_agg)
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[tuple[float, dict[str, float]]] = []
        for rows, real in self._plan(batch, micro_batches):
            part = self._part(batch, rows)
            logits = self._logits(self.model, part, temperature)
            new = token_logprobs(logits, part.responses)
            part_mask = part.response_mask.float()
            loss, metrics = policy_loss(
                new,
                part.logprobs,
                part.advantages,
                part_mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                dual_clip_c=cfg.dual_clip_c,
                agg=cfg.loss_agg,
                proximal_logprobs=part.proximal_logprobs,
                is_weights=part.is_weights,
            )
            if self.keeps_reference:  # KL(pi || pi_ref) penalty, estimated per token
                with torch.no_grad():
                    ref = token_logprobs(self._reference_logits(part, temperature), part.responses)
                kl = kl_penalty(new, ref, cfg.kl_estimator)
                loss = loss + cfg.kl_coef * aggregate(kl, part_mask, cfg.loss_agg)
                metrics["kl_ref"] = float((kl.detach() * part_mask).sum() / part_mask.sum().clamp(min=1))
            if cfg.entropy_coef or cfg.log_entropy:
                entropy = entropy_from_logits(logits) if cfg.entropy_coef else logged_entropy(logits)
                if cfg.entropy_coef:  # a bonus: higher entropy lowers the loss
                    loss = loss - cfg.entropy_coef * aggregate(entropy, part_mask, cfg.loss_agg)
                metrics["entropy"] = float(
                    (entropy.detach() * part_mask).sum() / part_mask.sum().clamp(min=1)
                )
            local = part_mask.sum() if cfg.loss_agg == "token-mean" else (part_mask.sum(-1) > 0).sum()
            share = float(local) / denominator if real else 0.0  # a filler adds nothing
            # The graph keeps what its backward needs of the logits and frees it there; a name
            # holding them would keep them [B, R, V] through the whole backward.
            del logits, new
            (loss * share).backward()  # the micro-batch's share of the batch loss
            if real:
                parts.append((float(part_mask.sum()), {"loss": loss.detach().item(), **metrics}))
            del loss
        if not self.sharded:  # FSDP2 reduce-scatters in backward (summing: see _fully_shard)
            self._all_reduce_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1
        totals = reduce_metrics(parts) if parts else {}
        totals.update(
            tokens=float(batch.response_mask.sum()),
            grad_norm=float(grad_norm),
            lr=float(self.scheduler.get_last_lr()[0]),
        )
        return totals

    def _all_reduce_gradients(self) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        for bucket in _buckets([p for p in self.model.parameters() if p.requires_grad]):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)  # a sum: each rank's loss already carries its share of the batch
            offset = 0
            for p, g in zip(bucket, grads):
                n = g.numel()
                p.grad = (
                    flat[offset : offset + n].view_as(p).clone()
                    if p.grad is None
                    else p.grad.copy_(flat[offset : offset + n].view_as(p))
                )
                offset += n

    def weights(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The current parameters by name, full (gathered when sharded: every rank must call
        it), detached copies on the CPU: what engines load. Tied weights appear once.
        ``copy=False`` returns the live tensors themselves when it can (to send them at once).
        With LoRA: the merged model, by the base model's names."""
        if not self.sharded:
            named = {
                name: p.detach() if not copy else p.detach().to("cpu", copy=True)
                for name, p in self.model.named_parameters()
            }
        else:
            sd = _state_dict()
            full: dict[str, Any] = sd.get_model_state_dict(
                self.model, options=sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            named = {name: full[name] for name, _ in self.model.named_parameters() if name in full}
        return lora.merged(named, lora.scaling(self.model)) if self.config.lora.rank else named

    @property
    def syncs_adapters(self) -> bool:
        """Whether a weight sync sends the LoRA adapters alone (``trainer.lora.sync: adapter``)."""
        return bool(self.config.lora.rank) and self.config.lora.sync == "adapter"

    @property
    def sync_scale(self) -> float:
        """What engines scale the adapters a weight sync sends by (``alpha / rank``); 0: a sync
        sends weights."""
        return lora.scaling(self.model) if self.syncs_adapters else 0.0

    def sync_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends, the live tensors where it can (every rank: gathering shards
        is collective): ``weights``, or with adapter sync the adapters (``lora.sync_tensors``)."""
        if not self.syncs_adapters:
            return self.weights(copy=False)
        if not self.sharded:
            return lora.sync_tensors({n: p.detach() for n, p in self.model.named_parameters()})
        sd = _state_dict()
        full: dict[str, Any] = sd.get_model_state_dict(
            self.model, options=sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return lora.sync_tensors(full)

    def weight_layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """What ``sync_tensors`` returns, as (name, shape, dtype) in its order: a weight sync's plan."""
        named = self.model.named_parameters()
        if self.syncs_adapters:
            return [(lora.sync_name(n), tuple(p.shape), _dtype(p)) for n, p in named if lora.is_adapter(n)]
        if self.config.lora.rank:
            return [
                (lora.base_name(n), tuple(p.shape), _dtype(p)) for n, p in named if not lora.is_adapter(n)
            ]
        return [(n, tuple(p.shape), _dtype(p)) for n, p in named]

    @property
    def sends_parameters(self) -> bool:
        """Whether ``sync_tensors`` are the parameters themselves (they may then live in the
        weight sync's buffer): not when sharded (gathered), nor with LoRA (merged, or a few)."""
        return not self.sharded and not self.config.lora.rank

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, folder: str | Path, *, write: bool = True) -> None:
        """The model as a Hugging Face folder (safetensors) plus ``optimizer.pt`` (optimizer
        state by parameter name, scheduler, step count). Gathered whole when sharded, so a
        checkpoint loads into any ``world_size`` and strategy; every rank calls it, ``write``
        on one."""
        state = self.state_to_save(keep=write)
        if state is not None:
            self.write_saved(folder, state)

    def state_to_save(self, *, keep: bool = True) -> dict[str, Any] | None:
        """What ``save`` writes, taken now (every rank: gathering shards is collective), as
        copies the training that goes on cannot change: ``write_saved`` may then write it while
        the next steps run. None where not ``keep`` (the ranks that do not write)."""
        if not self.sharded:  # a whole copy here: no collective, and copies made directly (2x faster)
            if not keep:
                return None
            return {
                **whole_state(self.model, self.optimizer),
                "scheduler": self.scheduler.state_dict(),
                "steps": self.steps,
            }
        sd = _state_dict()
        full = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = sd.get_model_state_dict(self.model, options=full)
        optimizer_state = sd.get_optimizer_state_dict(self.model, self.optimizer, options=full)
        if not keep:
            return None
        live = {t.data_ptr() for t in self.model.parameters()} | {t.data_ptr() for t in self.model.buffers()}
        live |= {
            t.data_ptr()
            for group in self.optimizer.state.values()
            for t in group.values()
            if isinstance(t, torch.Tensor)
        }
        return {
            "model": owned(model_state, live),
            "optimizer": owned(optimizer_state, live),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
        }

    def write_saved(self, folder: str | Path, state: dict[str, Any]) -> None:
        """Write a ``state_to_save`` into ``folder`` (blocking: any thread)."""
        folder = Path(folder)
        if self.config.lora.rank:  # the merged model to serve, and the adapter in PEFT's format
            merged = lora.merged(state["model"], lora.scaling(self.model))
            self.model.get_base_model().save_pretrained(
                folder / "model", state_dict=merged, safe_serialization=True
            )
            self.model.save_pretrained(folder / "adapter", state_dict=lora.adapter_state(state["model"]))
        else:
            self.model.save_pretrained(folder / "model", state_dict=state["model"], safe_serialization=True)
        torch.save(
            {"optimizer": state["optimizer"], "scheduler": state["scheduler"], "steps": state["steps"]},
            folder / "optimizer.pt",
        )

    def load(self, folder: str | Path) -> None:
        """Restore parameters and optimiser/scheduler state saved by ``save`` (every rank)."""
        folder = Path(folder)
        trained = [
            name for name, p in self.model.named_parameters() if p.requires_grad or not self.config.lora.rank
        ]
        if self.config.lora.rank:  # the adapter onto the base this trainer started from
            from safetensors.torch import load_file

            lora.check_base(self.model, folder / "model")
            state = lora.from_saved(load_file(str(folder / "adapter" / "adapter_model.safetensors")))
        else:
            state = read_safetensors(folder / "model")
        unexpected = sorted(
            set(state) - {name for name, _ in self.model.named_parameters()} - set(self.model.state_dict())
        )
        missing = [name for name in trained if name not in state]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {folder} does not fit the model: missing {missing}, unexpected {unexpected}"
            )
        sd = _state_dict()
        sd.set_model_state_dict(
            self.model, state, options=sd.StateDictOptions(full_state_dict=True, strict=False)
        )
        saved = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
        sd.set_optimizer_state_dict(
            self.model,
            self.optimizer,
            optim_state_dict=saved["optimizer"],
            options=sd.StateDictOptions(full_state_dict=True),
        )
        self.scheduler.load_state_dict(saved["scheduler"])
        self.steps = int(saved["steps"])


def _dtype(p: torch.Tensor) -> str:
    return str(p.dtype).removeprefix("torch.")


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits divided by the sampling temperature; at temperature 1 the model's own (no
    second [B, R, V]). Not in place: a model may need its logits for the backward (Gemma's
    soft-capping keeps its tanh's output)."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1 else logits


ENTROPY_CHUNK = 256
"""Positions whose entropy is computed at once when it is only logged: the softmax's temporaries
stay at this many rows of the vocabulary instead of the whole micro-batch's."""


@torch.no_grad()
def logged_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``entropy_from_logits`` without grad, a chunk of positions at a time (the same values:
    each position's entropy is its own row's)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], ENTROPY_CHUNK):
        out[start : start + ENTROPY_CHUNK] = entropy_from_logits(flat[start : start + ENTROPY_CHUNK])
    return out.view(logits.shape[:-1])


def _fully_shard(model: Any, device: torch.device) -> None:
    """FSDP2: shard each transformer block (the model's ``_no_split_modules``), then the rest.
    Reduce-scatter *sums* gradients (divide factor 1): each rank's loss already carries its
    share of the whole batch, as in the all-reduce path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def _buckets(params: list[torch.nn.Parameter]) -> Iterator[list[torch.nn.Parameter]]:
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _state_dict() -> Any:
    """``torch.distributed.checkpoint.state_dict``, imported when first used: it pulls in DTensor
    (0.6 s), which a rank's start (and a launch's first collective) does not need."""
    import torch.distributed.checkpoint.state_dict as state_dict

    return state_dict
