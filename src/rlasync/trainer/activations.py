"""What the backward keeps, made smaller without changing a gradient.

A training step's peak memory is the model's state plus what autograd keeps of one micro-batch's
forward for its backward. Two of those tensors are recomputed here instead, from what is kept
anyway, with the same kernels autograd's own backward runs: the gradients are the same bits.

- ``token_logprobs``: a token's logprob is its logit less the log-sum-exp of its row. Autograd
  builds its gradient from three vocabulary-wide temporaries (the softmax, the gather's scattered
  one-hot, their sum); here it is written into one: about 140 MB less at the peak for SmolLM2
  (49,152 words) at 800 response tokens. Liger-Kernel's and verl's fused log-prob kernels do the
  same on GPU, with a custom kernel.
- ``recompute_gated_activations`` (``trainer.recompute_mlp_activation``): a gated MLP,
  ``down(act(gate(x)) * up(x))`` (Llama, Qwen, Mistral, Gemma, SmolLM), keeps ``gate(x)`` for
  the activation's backward, ``act(gate(x))`` and ``up(x)`` for the product's, and the product
  for ``down``. The activation's output is recomputed in the backward from ``gate(x)`` instead:
  one tensor of the MLP's width less per layer and token (360 MB for SmolLM2-135M's 30 layers
  at 2,048 tokens), for one elementwise activation more per layer (Liger-Kernel's SwiGLU).
- ``enable_checkpointing`` (``trainer.gradient_checkpointing``): each transformer block keeps
  only its input and runs its forward again in the backward, on the same input with the same
  kernels: the same activations, so the same gradients, bit for bit.
"""

from __future__ import annotations

import types
from typing import Any

import torch


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(logits, tokens, lse)
        return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, tokens, lse = ctx.saved_tensors
        grad = grad.unsqueeze(-1)
        # d/dlogits (logit[t] - lse) = onehot(t) - softmax: -grad * softmax, then +grad at t,
        # the products and the sum autograd forms, in one tensor.
        out = torch.sub(logits, lse.unsqueeze(-1)).exp_().mul_(-grad)
        return out.scatter_add_(-1, tokens.unsqueeze(-1), grad), None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits and ``[...]`` token ids: each token's logprob, ``[...]``. Keeps only
    the logits for the backward (a log-softmax would keep its whole output too)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogprobs.apply(logits, tokens)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class _GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, act: Any) -> torch.Tensor:
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gate, up = ctx.saved_tensors
        with torch.enable_grad():  # the activation again, to run its own backward
            replay = gate.detach().requires_grad_()
            activated = ctx.act(replay)
        (grad_gate,) = torch.autograd.grad(activated, replay, grad * up)
        return grad_gate, grad * activated.detach(), None


def _gated_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_GatedActivation.apply(self.gate_proj(x), self.up_proj(x), self.act_fn))


def recompute_gated_activations(model: torch.nn.Module) -> int:
    """Every gated MLP of ``model`` (a module with ``gate_proj``, ``up_proj``, ``down_proj`` and
    ``act_fn``) recomputes its activation in the backward; the number changed. A module is
    changed only where its forward, tried on one random row, gives exactly what its own gives:
    an MLP that computes something else (a bias after the product, experts) is left as it was.
    Call it before ``lora.wrap`` and before sharding (the trial runs the module alone)."""
    changed = 0
    for module in model.modules():
        gate, up, down = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
        linear = torch.nn.Linear
        if not (isinstance(gate, linear) and isinstance(up, linear) and isinstance(down, linear)):
            continue
        if not callable(getattr(module, "act_fn", None)):
            continue
        weight = gate.weight
        if weight.is_meta:
            continue
        own, had_own = module.forward, "forward" in module.__dict__
        generator = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(1, 2, weight.shape[1], generator=generator, device=weight.device, dtype=weight.dtype)
        module.forward = types.MethodType(_gated_forward, module)
        try:
            with torch.no_grad():
                same = torch.equal(own(x), module(x))
        except (RuntimeError, TypeError, ValueError):
            same = False
        if same:
            changed += 1
        elif had_own:
            module.forward = own
        else:
            del module.forward  # the class's own again
    return changed


def enable_checkpointing(model: Any) -> None:
    """Activation checkpointing on each transformer block (transformers' own, non-reentrant:
    it composes with FSDP2 and needs no input that requires grad). A model transformers did not
    build is a ``ValueError`` naming the setting."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"trainer.gradient_checkpointing: {type(model).__name__} does not support it (a transformers model does)"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
