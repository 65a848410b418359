"""Algorithms: every function against values worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import chain_rtol

from rlasync.algorithms import (
    aggregate,
    broadcast_to_tokens,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    offpolicy_metrics,
    overlong_penalty,
    policy_loss,
    reinforce_pp_baseline_advantages,
    rejection_mask,
    rloo_advantages,
    tis_weights,
)

pytestmark = pytest.mark.numerics

LN2 = math.log(2.0)

# Every figure here is at most ~16 float32 operations from inputs of size <= 5 (an exp, a log, a
# product, a sum or mean over <= 8 terms, a std), each within one ulp (2^-23 relative: the
# vectorised exp and log of the AVX-512, AVX2 and plain code paths are within one ulp, not half):
# so within chain_rtol(32) of its scale, which is the value itself, or the inputs' (~1) for a
# value that cancels to 0. (pytest.approx's default, rel=1e-6, is the same ~16 ulps.)
HAND = chain_rtol(32)


def close(actual: torch.Tensor, expected: list | float) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=HAND, rtol=HAND)


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_plain_floats(metrics: dict[str, float]) -> None:
    assert metrics and all(type(v) is float for v in metrics.values()), metrics


# ---------------------------------------------------------------- advantages


def test_grpo_one_group_with_and_without_std() -> None:
    # rewards [1,0,1,1]: mean 0.75, deviations [0.25,-0.75,0.25,0.25]
    # sum of squares 3*0.0625 + 0.5625 = 0.75; unbiased var 0.75/3 = 0.25; std 0.5
    rewards = t([1, 0, 1, 1])
    close(grpo_advantages(rewards, 4), [0.5, -1.5, 0.5, 0.5])
    close(grpo_advantages(rewards, 4, std_normalize=False), [0.25, -0.75, 0.25, 0.25])
    # eps sits in the denominator: 0.25 / (0.5 + 0.5) = 0.25
    close(grpo_advantages(rewards, 4, eps=0.5), [0.25, -0.75, 0.25, 0.25])


def test_grpo_two_groups_by_ids_and_by_size() -> None:
    # group 7 = [1,0]: mean 0.5, deviations ±0.5, var (0.25+0.25)/1 = 0.5, std √0.5 → ±0.5/√0.5 = ±√0.5
    # group 3 = [2,4]: mean 3, deviations ∓1, var 2/1 = 2, std √2 → ∓1/√2 = ∓√0.5
    rewards = t([1, 0, 2, 4])
    s = math.sqrt(0.5)
    close(grpo_advantages(rewards, torch.tensor([7, 7, 3, 3])), [s, -s, -s, s])
    close(grpo_advantages(rewards, 2), [s, -s, -s, s])
    close(grpo_advantages(rewards, 2, std_normalize=False), [0.5, -0.5, -1.0, 1.0])


def test_grpo_single_sample_group_and_constant_group_are_zero_not_nan() -> None:
    # group 0 = [1,0,1]: mean 2/3, deviations [1/3,-2/3,1/3], sum sq 6/9, var (2/3)/2 = 1/3, std 1/√3
    #   → [1/3·√3, -2/3·√3, 1/3·√3]; group 1 = [5] alone → 0; group 2 = [1,1] → 0/(0+eps) = 0
    rewards = t([1, 0, 1, 5, 1, 1])
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1, 2, 2]))
    r3 = math.sqrt(3)
    close(adv, [r3 / 3, -2 * r3 / 3, r3 / 3, 0.0, 0.0, 0.0])
    assert torch.isfinite(adv).all()
    assert torch.isfinite(grpo_advantages(t([3.0]), 1)).all() and grpo_advantages(t([3.0]), 1).item() == 0.0


def test_grpo_rejects_group_size_that_does_not_divide_batch() -> None:
    with pytest.raises(ValueError, match="group_size=3"):
        grpo_advantages(t([1, 0, 1, 1]), 3)


def test_rloo() -> None:
    # group [1,0,1,1]: A_i = r_i - mean of the other three
    #   A_0 = 1 - (0+1+1)/3 = 1/3, A_1 = 0 - 3/3 = -1, A_2 = A_3 = 1/3
    # group [4] alone → 0
    adv = rloo_advantages(t([1, 0, 1, 1, 4]), torch.tensor([0, 0, 0, 0, 1]))
    close(adv, [1 / 3, -1.0, 1 / 3, 1 / 3, 0.0])
    # group size 2, [2,4]: A = 2-4 = -2, 4-2 = 2
    close(rloo_advantages(t([2, 4]), 2), [-2.0, 2.0])


def test_reinforce_pp_baseline_per_sequence_whitening() -> None:
    # groups of 2: [1,0] mean 0.5 → b = [0.5,-0.5]; [2,4] mean 3 → b = [-1,1]
    # batch mean of b = 0; unbiased var (0.25+0.25+1+1)/3 = 2.5/3; A = b / √(2.5/3)
    adv = reinforce_pp_baseline_advantages(t([1, 0, 2, 4]), 2)
    std = math.sqrt(2.5 / 3)
    close(adv, [0.5 / std, -0.5 / std, -1 / std, 1 / std])


def test_reinforce_pp_baseline_token_weighted_whitening_matches_verl() -> None:
    # same b = [0.5,-0.5,-1,1]; lengths [1,3,2,2], 8 tokens
    # mu = (1·0.5 + 3·(-0.5) + 2·(-1) + 2·1)/8 = -1/8
    # deviations [0.625,-0.375,-0.875,1.125]; weighted sum sq 0.390625+3·0.140625+2·0.765625+2·1.265625 = 4.875
    # unbiased var 4.875/7; A = deviation / √(4.875/7)
    mask = t([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    adv = reinforce_pp_baseline_advantages(t([1, 0, 2, 4]), 2, mask=mask)
    std = math.sqrt(4.875 / 7)
    close(adv, [0.625 / std, -0.375 / std, -0.875 / std, 1.125 / std])
    # cross-check: whiten the token-level tensor the way verl does (masked mean, Bessel-corrected masked var)
    b = t([0.5, -0.5, -1, 1])
    tokens = b[:, None] * mask
    mean = (tokens * mask).sum() / mask.sum()
    var = (((tokens - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    verl_style = (tokens - mean) * torch.rsqrt(var + 1e-8) * mask
    close(broadcast_to_tokens(adv, mask), verl_style.tolist())


def test_broadcast_to_tokens() -> None:
    out = broadcast_to_tokens(t([2, -1]), torch.tensor([[True, True, False], [True, False, False]]))
    close(out, [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


# ---------------------------------------------------------------- policy loss


def one_token_loss(adv: float, ratio: float, **kwargs: object) -> tuple[float, dict[str, float]]:
    # old logprob 0, new logprob ln(ratio): r = ratio exactly
    loss, metrics = policy_loss(t([[math.log(ratio)]]), t([[0.0]]), t([[adv]]), t([[1.0]]), **kwargs)  # type: ignore[arg-type]
    return loss.item(), metrics


@pytest.mark.parametrize(
    ("adv", "ratio", "expected", "clipped"),
    [
        (1.0, 1.1, -1.1, 0.0),  # inside [0.8, 1.2]: -A r
        (1.0, 1.5, -1.2, 1.0),  # above: max(-1.5, -1.2) = -1.2, the clipped term
        (1.0, 0.5, -0.5, 0.0),  # below with A > 0: max(-0.5, -0.8) = -0.5, unclipped (pessimistic)
        (-1.0, 0.5, 0.8, 1.0),  # below with A < 0: max(0.5, 0.8) = 0.8, clipped
        (-1.0, 1.5, 1.5, 0.0),  # above with A < 0: max(1.5, 1.2) = 1.5, unclipped
        (-1.0, 1.1, 1.1, 0.0),  # inside
    ],
)
def test_ppo_clip(adv: float, ratio: float, expected: float, clipped: float) -> None:
    loss, metrics = one_token_loss(adv, ratio)
    assert loss == pytest.approx(expected, rel=HAND, abs=HAND)
    assert metrics["pg_clipfrac"] == clipped
    assert metrics["ratio_mean"] == pytest.approx(ratio, rel=HAND, abs=HAND)
    assert metrics["ppo_kl"] == pytest.approx(-math.log(ratio), rel=HAND, abs=HAND)
    assert_plain_floats(metrics)


def test_clip_higher_asymmetry() -> None:
    # clip_high 0.28: r = 1.25 < 1.28 stays unclipped → -1.25 (symmetric 0.2 would give -1.2)
    assert one_token_loss(1.0, 1.25, clip_high=0.28)[0] == pytest.approx(-1.25, rel=HAND, abs=HAND)
    assert one_token_loss(1.0, 1.25)[0] == pytest.approx(-1.2, rel=HAND, abs=HAND)
    # the low side still clips at 1 - 0.2 = 0.8: A = -1, r = 0.75 → max(0.75, 0.8) = 0.8
    assert one_token_loss(-1.0, 0.75, clip_high=0.28)[0] == pytest.approx(0.8, rel=HAND, abs=HAND)
    # clip_low 0.3: 0.75 is inside [0.7, 1.2] → 0.75
    assert one_token_loss(-1.0, 0.75, clip_low=0.3)[0] == pytest.approx(0.75, rel=HAND, abs=HAND)


def test_dual_clip() -> None:
    # A = -1, r = 5: PPO gives max(5, 1.2) = 5; dual clip c = 3 caps it at -A c = 3
    assert one_token_loss(-1.0, 5.0)[0] == pytest.approx(5.0, rel=HAND, abs=HAND)
    loss, metrics = one_token_loss(-1.0, 5.0, dual_clip_c=3.0)
    assert loss == pytest.approx(3.0, rel=HAND, abs=HAND) and metrics["pg_clipfrac_lower"] == 1.0
    # below the cap it changes nothing: A = -1, r = 2 → 2
    loss, metrics = one_token_loss(-1.0, 2.0, dual_clip_c=3.0)
    assert loss == pytest.approx(2.0, rel=HAND, abs=HAND) and metrics["pg_clipfrac_lower"] == 0.0
    # positive advantages are untouched: A = 1, r = 5 → -1.2
    assert one_token_loss(1.0, 5.0, dual_clip_c=3.0)[0] == pytest.approx(-1.2, rel=HAND, abs=HAND)
    with pytest.raises(ValueError, match="dual_clip_c"):
        one_token_loss(-1.0, 5.0, dual_clip_c=1.0)


def test_aggregate_modes_with_ragged_mask() -> None:
    loss_mat = t([[1, 2, 3], [4, 0, 0], [9, 9, 9]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third sequence fully masked: ignored
    # token-mean: (1+2+3+4)/4 = 2.5
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: mean(6/3, 4/1) = 3
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum: mean(6, 4) = 5
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # a global normaliser for micro-batching: 10 / 8 tokens
    assert aggregate(loss_mat, mask, "token-mean", denominator=8).item() == pytest.approx(1.25)
    # nothing valid → 0, not NaN
    assert aggregate(loss_mat, torch.zeros(3, 3), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(loss_mat, mask, "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", -1.25),  # -(1+1+1+2)/4
        ("seq-mean-token-mean", -1.5),  # -mean(3/3, 2/1)
        ("seq-mean-token-sum", -2.5),  # -mean(3, 2)
    ],
)
def test_policy_loss_aggregation(agg: str, expected: float) -> None:
    # r = 1 everywhere, so the per-token loss is -A; padding carries garbage that must not count
    zeros = torch.zeros(2, 3)
    adv = t([[1, 1, 1], [2, 50, 50]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, _ = policy_loss(zeros, zeros, adv, mask, agg=agg)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(expected)


def test_policy_loss_takes_sequence_advantages() -> None:
    # [N] advantages broadcast over tokens: same as passing them pre-broadcast
    logp, old, mask = torch.randn(2, 3) * 0.3, torch.randn(2, 3) * 0.3, t([[1, 1, 0], [1, 1, 1]])
    a, _ = policy_loss(logp, old, t([1.0, -2.0]), mask)
    b, _ = policy_loss(logp, old, t([[1, 1, 1], [-2, -2, -2]]), mask)
    assert a.item() == pytest.approx(b.item())


def test_decoupled_ppo_equals_plain_ppo_when_proximal_is_behaviour() -> None:
    torch.manual_seed(0)
    old = torch.randn(3, 4) * 0.5
    logp1 = (old + torch.randn(3, 4) * 0.4).requires_grad_()
    logp2 = logp1.detach().clone().requires_grad_()
    adv, mask = torch.randn(3, 4), t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    plain, m1 = policy_loss(logp1, old, adv, mask, dual_clip_c=3.0)
    decoupled, m2 = policy_loss(logp2, old, adv, mask, dual_clip_c=3.0, proximal_logprobs=old.clone())
    plain.backward()
    decoupled.backward()
    assert decoupled.item() == pytest.approx(plain.item(), rel=HAND, abs=HAND)
    torch.testing.assert_close(logp2.grad, logp1.grad)
    assert m2["behav_weight_mean"] == 1.0 and m2["pg_clipfrac"] == m1["pg_clipfrac"]


def test_decoupled_ppo_clips_against_proximal_and_weights_by_behaviour() -> None:
    # behaviour p = 0.5, proximal p = 1, current p = 1.1 (as logprobs; only the differences matter)
    # ratio vs proximal = 1.1 → inside the clip → -A r = -1.1; behaviour weight exp(0 - ln 0.5) = 2 → -2.2
    # (plain PPO against the behaviour policy: r = 2.2, clipped → -1.2)
    logp, old, prox = t([[math.log(1.1)]]), t([[math.log(0.5)]]), t([[0.0]])
    loss, metrics = policy_loss(logp, old, t([[1.0]]), t([[1.0]]), proximal_logprobs=prox)
    assert loss.item() == pytest.approx(-2.2, rel=HAND, abs=HAND)
    assert metrics["behav_weight_mean"] == pytest.approx(2.0) and metrics["pg_clipfrac"] == 0.0
    assert policy_loss(logp, old, t([[1.0]]), t([[1.0]]))[0].item() == pytest.approx(-1.2, rel=HAND, abs=HAND)


def test_is_weights_scale_the_per_token_loss() -> None:
    # r = 1, A = [1, 1]: per-token loss -1; weights [0.5, 2] → token-mean (-0.5 - 2)/2 = -1.25
    zeros = torch.zeros(1, 2)
    loss, _ = policy_loss(zeros, zeros, t([[1, 1]]), t([[1, 1]]), is_weights=t([[0.5, 2.0]]))
    assert loss.item() == pytest.approx(-1.25)


def test_gradients_flow_and_clipped_tokens_get_none() -> None:
    # tokens: (A=+1, r=1.5) clipped → -1.2, constant; (A=+1, r=1.1) → -r; (A=-1, r=5) dual-clipped → 3, constant;
    #         (A=-1, r=1.5) unclipped → +r. token-mean over 4: dL/dlogp = dL/dr · r / 4
    ratios = [1.5, 1.1, 5.0, 1.5]
    logp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 4), t([[1, 1, -1, -1]]), torch.ones(1, 4), dual_clip_c=3.0)
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 3.0 + 1.5) / 4, rel=HAND, abs=HAND)
    loss.backward()
    assert logp.grad is not None
    close(logp.grad, [[0.0, -1.1 / 4, 0.0, 1.5 / 4]])


# ---------------------------------------------------------------- entropy and KL


def test_entropy_of_uniform_is_log_v() -> None:
    # uniform over V = 5 → H = log 5, for every position, whatever the constant logit
    logits = torch.zeros(2, 3, 5)
    logits[1] += 1000.0  # large logits must not overflow
    close(entropy_from_logits(logits), [[math.log(5)] * 3] * 2)


def test_entropy_of_known_distribution() -> None:
    # logits [0, ln 3] → p = [1/4, 3/4]; H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.25·ln4 + 0.75·ln(4/3)
    expected = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)
    close(entropy_from_logits(t([[[0.0, math.log(3)]]])), [[expected]])


def test_kl_estimators_on_known_values() -> None:
    # logp = ln 0.5, ref = ln 0.25: d = ln 2
    #   k1 = ln 2; k2 = (ln 2)²/2; k3 = exp(-d) + d - 1 = 0.5 + ln 2 - 1
    # reversed (d = -ln 2): k1 = -ln 2; k2 same; k3 = 2 - ln 2 - 1
    logp, ref = t([math.log(0.5), math.log(0.25)]), t([math.log(0.25), math.log(0.5)])
    close(kl_penalty(logp, ref, "k1"), [LN2, -LN2])
    close(kl_penalty(logp, ref, "k2"), [LN2**2 / 2, LN2**2 / 2])
    close(kl_penalty(logp, ref, "k3"), [0.5 + LN2 - 1, 1 - LN2])
    close(kl_penalty(logp, ref, "low_var_kl"), [0.5 + LN2 - 1, 1 - LN2])
    # equal policies: all zero
    assert kl_penalty(logp, logp, "k3").abs().max().item() == 0.0
    torch.manual_seed(0)
    assert (kl_penalty(torch.randn(1000) * 3, torch.randn(1000) * 3, "k3") >= 0).all()
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


# ---------------------------------------------------------------- off-policy correction


def test_tis_token_level_truncates_at_threshold() -> None:
    # rho = [0.5, 1.5, 3, (pad)] → min(rho, 2) = [0.5, 1.5, 2, 0]
    train = torch.tensor([[math.log(0.5), math.log(1.5), math.log(3.0), 5.0]], requires_grad=True)
    rollout, mask = torch.zeros(1, 4), t([[1, 1, 1, 0]])
    w, metrics = tis_weights(train, rollout, mask, level="token", threshold=2.0)
    close(w, [[0.5, 1.5, 2.0, 0.0]])
    assert not w.requires_grad
    # mean over valid tokens (0.5+1.5+2)/3 = 4/3; one of three truncated
    assert metrics["tis_mean"] == pytest.approx(4 / 3) and metrics["tis_clip_frac"] == pytest.approx(1 / 3)
    assert_plain_floats(metrics)


def test_tis_sequence_level_uses_the_product_over_valid_tokens() -> None:
    # seq 0: 1.5·1.2 = 1.8 → 1.8; seq 1: 2·1.5 = 3 → 2; seq 2: 0.5 (padding's ratio 100 is left out) → 0.5
    train = t([[math.log(1.5), math.log(1.2)], [LN2, math.log(1.5)], [math.log(0.5), math.log(100.0)]])
    mask = t([[1, 1], [1, 1], [1, 0]])
    w, metrics = tis_weights(train, torch.zeros(3, 2), mask, level="sequence", threshold=2.0)
    close(w, [[1.8, 1.8], [2.0, 2.0], [0.5, 0.0]])
    assert metrics["tis_clip_frac"] == pytest.approx(1 / 3)  # one sequence of three
    with pytest.raises(ValueError, match="level"):
        tis_weights(train, torch.zeros(3, 2), mask, level="batch")  # type: ignore[arg-type]


def test_rejection_mask_token_level() -> None:
    # rho = [0.4, 1.0, 2.5, 1.9, (pad)], default low = 1/high = 0.5 → keep [0, 1, 0, 1, 0]
    train = t([[math.log(0.4), 0.0, math.log(2.5), math.log(1.9), 0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    kept, metrics = rejection_mask(train, torch.zeros(1, 5), mask, high=2.0)
    assert kept.dtype == torch.bool and kept.tolist() == [[False, True, False, True, False]]
    assert metrics["rejected_token_frac"] == pytest.approx(0.5) and metrics["rejected_seq_frac"] == 1.0
    # an explicit low bound of 0.3 keeps the 0.4 token
    kept, _ = rejection_mask(train, torch.zeros(1, 5), mask, low=0.3, high=2.0)
    assert kept.tolist() == [[True, True, False, True, False]]


def test_rejection_mask_sequence_level_uses_geometric_mean() -> None:
    # seq 0: rho [4, 0.5] → geometric mean √2 ≈ 1.41 ∈ [0.5, 2] → kept
    # seq 1: rho [4, 1.5] → √6 ≈ 2.45 > 2 → dropped
    # seq 2: rho [0.25, pad] → 0.25 < 0.5 → dropped (padding stays 0)
    train = t([[math.log(4), math.log(0.5)], [math.log(4), math.log(1.5)], [math.log(0.25), 9.0]])
    mask = t([[1, 1], [1, 1], [1, 0]])
    kept, metrics = rejection_mask(train, torch.zeros(3, 2), mask, level="sequence", high=2.0)
    assert kept.dtype == torch.float32
    close(kept, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    assert metrics["rejected_token_frac"] == pytest.approx(3 / 5) and metrics[
        "rejected_seq_frac"
    ] == pytest.approx(2 / 3)


def test_offpolicy_metrics() -> None:
    # seq 0: train p [0.5, 0.5], rollout p [0.25, 0.5]; seq 1: train 0.2, rollout 0.4, then padding; seq 2 all padding
    # rho over valid tokens = [2, 1, 0.5]: mean 3.5/3, min 0.5, max 2
    # kl_k1 = mean(ln mu - ln pi) = mean(-ln2, 0, ln2) = 0
    # kl_k3 = mean(rho - ln rho - 1) = ((2 - ln2 - 1) + 0 + (0.5 + ln2 - 1)) / 3 = 0.5/3
    # training ppl: seq 0 exp(-ln 0.5) = 2, seq 1 exp(-ln 0.2) = 5 → 3.5
    # rollout ppl: seq 0 exp(-(ln 0.25 + ln 0.5)/2) = √8, seq 1 exp(-ln 0.4) = 2.5 → (√8 + 2.5)/2
    ln = math.log
    train = t([[ln(0.5), ln(0.5)], [ln(0.2), -100.0], [-100.0, -100.0]])
    rollout = t([[ln(0.25), ln(0.5)], [ln(0.4), -3.0], [-7.0, -1.0]])
    mask = t([[1, 1], [1, 0], [0, 0]])
    m = offpolicy_metrics(train, rollout, mask)
    assert_plain_floats(m)
    assert m["ratio_mean"] == pytest.approx(3.5 / 3, rel=HAND, abs=HAND)
    assert m["ratio_min"] == pytest.approx(0.5, rel=HAND, abs=HAND) and m["ratio_max"] == pytest.approx(
        2.0, rel=HAND, abs=HAND
    )
    assert m["kl_k1"] == pytest.approx(0.0, rel=HAND, abs=HAND)
    assert m["kl_k3"] == pytest.approx(0.5 / 3, rel=HAND, abs=HAND)
    assert m["training_ppl"] == pytest.approx(3.5, rel=HAND, abs=HAND)
    assert m["rollout_ppl"] == pytest.approx((math.sqrt(8) + 2.5) / 2, rel=HAND, abs=HAND)


def test_overlong_penalty_falls_linearly_over_the_buffer_to_the_limit() -> None:
    lengths = torch.tensor([0, 12, 13, 14, 16])
    got = overlong_penalty(lengths, limit=16, buffer=4, penalty=0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    with pytest.raises(ValueError, match="buffer <= limit"):
        overlong_penalty(lengths, limit=4, buffer=8)
