"""The bounds of ``tests/numerics.py`` hold against float32 sums taken in other orders, and are
not so loose that they would pass anything: each is checked against a real difference it must
catch. Seeded, so a failure here is the bound's fault, not the draw's."""

from __future__ import annotations

import math

import numerics
import pytest
import torch

pytestmark = pytest.mark.numerics


def _orders(terms: torch.Tensor) -> list[torch.Tensor]:
    """One float32 sum of ``terms`` per order a kernel might take: left to right, pairwise
    (torch's own), in chunks of 8 and 16 (SIMD lanes), and reversed after a shuffle."""
    sequential = torch.zeros((), dtype=torch.float32)
    for term in terms:
        sequential = sequential + term
    chunked = [terms.view(-1, width).sum(dim=0).sum() for width in (8, 16)]
    shuffled = terms[torch.randperm(terms.numel())].flip(0).sum()
    return [sequential, terms.sum(), *chunked, shuffled]


@pytest.mark.parametrize("n", [64, 512, 4096])
def test_any_order_of_a_sum_is_within_gamma_n_of_the_exact_one(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    for _ in range(20):
        terms = torch.randn(n, generator=generator) * 10.0 ** torch.randint(-3, 3, (n,), generator=generator)
        exact = float(terms.double().sum())
        allowance = numerics.chain_rtol(n) * float(terms.double().abs().sum())
        for total in _orders(terms):
            assert abs(float(total) - exact) <= allowance


def test_two_orders_agree_to_twice_the_bound_and_the_bound_is_not_vacuous() -> None:
    terms = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    allowance = numerics.chain_rtol(4096) * float(terms.abs().sum())
    orders = _orders(terms)
    assert all(abs(float(a - b)) <= 2 * allowance for a in orders for b in orders)
    # A real error (one term dropped) is far outside it.
    assert abs(float(terms[1:].sum() - terms.sum())) > 2 * allowance or abs(float(terms[0])) < 2 * allowance


def test_chain_rtol_is_gamma_of_the_total_length() -> None:
    assert numerics.chain_rtol(100) == pytest.approx(100 * 2**-24 / (1 - 100 * 2**-24))
    assert numerics.chain_rtol(30, 70) == numerics.chain_rtol(100)


def test_a_matmul_in_chunks_is_within_the_forward_bound_of_its_length() -> None:
    # A projection's output is a dot product over its input width: another blocking (what another
    # ISA or thread split does) moves it by at most gamma_width of the terms' scale.
    generator = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 512, generator=generator), torch.randn(512, 128, generator=generator)
    whole = x @ w
    blocked = sum(x[:, k : k + 64] @ w[k : k + 64] for k in range(0, 512, 64))
    exact = x.double() @ w.double()
    scale = (x.double().abs() @ w.double().abs()).max()
    assert float((whole.double() - exact).abs().max()) <= numerics.chain_rtol(512) * float(scale)
    assert float((blocked.double() - exact).abs().max()) <= numerics.chain_rtol(512) * float(scale)


def _sgd(start: dict[str, torch.Tensor], gradient: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: start[name] - gradient[name] for name in start}


def test_same_sgd_step_accepts_rounding_and_rejects_a_changed_gradient() -> None:
    generator = torch.Generator().manual_seed(2)
    start = {"w": torch.randn(64, 64, generator=generator)}
    gradient = {"w": torch.randn(64, 64, generator=generator) * 1e-2}
    rtol = numerics.chain_rtol(1000)
    nudged = {"w": gradient["w"] * (1 + rtol / 4 * torch.randn(64, 64, generator=generator).clamp(-1, 1))}
    assert (
        numerics.assert_same_sgd_step(start, _sgd(start, gradient), _sgd(start, nudged), lr=1.0, rtol=rtol)
        <= 1
    )
    wrong = {"w": gradient["w"].clone()}
    wrong["w"][3, 5] += 1e-3  # one entry off by far more than rounding
    with pytest.raises(AssertionError, match="beyond rounding"):
        numerics.assert_same_sgd_step(start, _sgd(start, gradient), _sgd(start, wrong), lr=1.0, rtol=rtol)


def test_adamw_check_is_tight_where_the_gradient_is_large_and_loose_where_it_is_not() -> None:
    lr, eps = 1e-3, 1e-8
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(256, generator=generator)
    sign = torch.randint(0, 2, (256,), generator=generator) * 2 - 1
    g = sign * (0.1 + torch.rand(256, generator=generator)) * 1e-3  # all well above eps ...
    g[:8] = 1e-10  # near eps: the step may be anything in [-lr, lr]
    step = lambda grad: start - lr * grad / (grad.abs() + eps)  # noqa: E731
    flipped = g.clone()
    flipped[:8] = -flipped[:8]  # rounding can flip the sign of a gradient that small
    tight, total = numerics.adamw_first_steps_agree(
        {"w": step(g)}, {"w": step(flipped)}, {"w": g}, lr=lr, rtol=numerics.chain_rtol(1000), eps=eps
    )
    assert (tight, total) == (248, 256)
    moved = g.clone()
    moved[100] = -moved[100]  # a large gradient whose sign changed is a real difference
    with pytest.raises(AssertionError, match="well above eps"):
        numerics.adamw_first_steps_agree(
            {"w": step(g)}, {"w": step(moved)}, {"w": g}, lr=lr, rtol=numerics.chain_rtol(1000), eps=eps
        )


def test_rounding_close_is_relative_to_the_tensor_scale() -> None:
    a = torch.tensor([1000.0, 1e-6])
    assert numerics.rounding_close(a, a + torch.tensor([0.0, 1e-3]), 1e-5)  # 1e-3 <= 1e-5 * 1000
    assert not numerics.rounding_close(a, a + torch.tensor([0.0, 1e-1]), 1e-5)
    assert math.isclose(numerics.UNIT_ROUNDOFF, torch.finfo(torch.float32).eps / 2)
