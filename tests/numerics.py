"""Tolerances that follow from float32 arithmetic, not from one machine's results.

Two computations of one float32 value that add in another order (other ranks, other
micro-batches, another SIMD width or thread split: AVX-512, AVX2 and plain code paths all do)
differ by rounding alone. A sum of n terms is exact to ``gamma_n * sum(|term|)`` (Higham,
*Accuracy and Stability of Numerical Algorithms*, 4.2: ``gamma_n = n u / (1 - n u)``, with
u = 2^-24 for float32), whatever the order; a value computed through several reductions one
after another adds their gammas, to first order. So two such values agree to ``rtol * scale``,
``rtol`` from the lengths of the reductions, ``scale`` the size of the terms, which for a
tensor we take to be its largest entry: an entry near zero is a sum whose terms cancelled, and
its error is that of its terms, not of its value (a relative tolerance per entry would fail it).

``make test-numerics`` runs the tests that use them under every CPU code path torch takes here
(``tests/unit/test_numerics.py`` checks the bounds against sums taken in other orders).
"""

from __future__ import annotations

from typing import Any

import torch

UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff: a rounded operation is exact to this relative error."""


def chain_rtol(*lengths: int) -> float:
    """The first-order bound on the relative error (to the terms' scale) of a value computed
    through reductions of these lengths one after another: ``gamma`` of their total length."""
    n = sum(lengths)
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def forward_length(config: Any, *, sequence: int) -> int:
    """The reductions one forward of a Qwen2-style decoder (``config``: its Hugging Face config)
    takes a logprob through, in rows of up to ``sequence`` positions: per layer, over the hidden
    width in the two RMSNorms and the q/k/v, o and gate/up projections (5), over a head's width
    (the scores) and the sequence (the weighted sum) in attention, over the intermediate width
    in the down projection; then over the hidden width in the final norm and the LM head, and
    over the vocabulary in the log-softmax."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    per_layer = 5 * hidden + head + sequence + config.intermediate_size
    return layers * per_layer + 2 * hidden + config.vocab_size


def forward_rtol(config: Any, *, sequence: int) -> float:
    """How far two float32 forwards of the same rows (logprobs) may differ, relative to their scale."""
    return chain_rtol(forward_length(config, sequence=sequence))


def step_rtol(config: Any, *, tokens: int, sequence: int) -> float:
    """How far two float32 computations of one training step (its loss, its summed gradients)
    may differ, relative to their scale, for a batch of ``tokens`` positions in rows of up to
    ``sequence``: the forward's reductions, the backward's (the same ones transposed, of the same
    lengths), and a weight's gradient summed over every position of the batch."""
    return chain_rtol(2 * forward_length(config, sequence=sequence), tokens)


def assert_same_sgd_step(
    start: dict[str, torch.Tensor],
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    *,
    lr: float,
    rtol: float,
) -> float:
    """Assert that two plain SGD steps of ``lr`` (no weight decay) from ``start`` applied the same
    summed gradient up to rounding: ``g = (start - after) / lr`` per tensor within ``rtol`` of its
    scale, plus what reading g off the weights costs: ``after = start - lr * g`` is rounded to
    2^-24 of ``|after|``, so g is known to ``2^-24 |after| / lr`` on each side (it matters for
    gradients far smaller than the weights). Returns the worst share of the allowance used."""
    worst = 0.0
    for name in start:
        ga, gb = (start[name] - a[name]) / lr, (start[name] - b[name]) / lr
        readout = UNIT_ROUNDOFF * (a[name].abs() + b[name].abs()) / lr
        scale = float(torch.maximum(ga.abs().max(), gb.abs().max()))
        used = float(((ga - gb).abs() / (rtol * scale + readout)).max())
        assert used <= 1.0, (
            f"{name}: the summed gradients differ beyond rounding ({used:.3g} of the allowance)"
        )
        worst = max(worst, used)
    return worst


def adamw_first_steps_agree(
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    gradients: dict[str, torch.Tensor],
    *,
    lr: float,
    rtol: float,
    eps: float = 1e-8,
) -> tuple[int, int]:
    """Assert that two weights after one AdamW step (betas, no decay) from the same start took the
    same step, where that can be told from rounding: AdamW's first update is
    ``lr * g / (|g| + eps)``, whose derivative in g is ``lr * eps / (|g| + eps)^2``. Where
    ``|g| >= 1000 eps`` and g's rounding (``rtol`` of its tensor's scale) is at most a tenth of
    ``|g|`` (so its sign is sure), two gradients equal up to rounding move a weight alike to
    ``lr * 1e-3 * 0.1``, plus one rounding of the weight itself (its float32 spacing). Elsewhere
    the update is any value in ``[-lr, lr]``: there the two agree to ``2 lr``, which is all the
    maths says. Returns (entries checked tightly, entries in all)."""
    tight = total = 0
    for name, g in gradients.items():
        sure = (g.abs() >= 1000 * eps) & (g.abs() >= 10 * rtol * float(g.abs().max()))
        diff = (a[name] - b[name]).abs()
        spacing = torch.finfo(torch.float32).eps * torch.maximum(a[name].abs(), b[name].abs())
        bound = lr * 1e-4 + spacing
        assert bool((diff[sure] <= bound[sure]).all()), (
            f"{name}: AdamW steps differ by {float((diff - bound)[sure].max()):.3g} beyond the bound "
            "where the gradient is well above eps"
        )
        assert float(diff.max()) <= 2 * lr + float(spacing.max()), name
        tight, total = tight + int(sure.sum()), total + g.numel()
    return tight, total


def rounding_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> bool:
    """Whether two float32 computations of one tensor agree to ``rtol`` of its scale (its largest
    entry): the check for values whose reductions ran in another order."""
    scale = float(torch.maximum(actual.abs().max(), expected.abs().max()))
    return float((actual - expected).abs().max()) <= rtol * scale
