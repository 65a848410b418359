"""Profiles: a published setup's physics as the simulator's cost model (a model's shape and a
GPU's figures -> the decode roofline, the KV cache's capacity, the trainer's phases)."""

from __future__ import annotations

import random

import msgspec
import pytest

from rlasync.engines.sim import LogNormalLengths
from rlasync.modes.profiles import H20, PROFILES, QWEN25_MATH_7B, Phase, Profile, lengths_moment


def test_the_roofline_follows_from_the_model_s_shape_and_the_gpu() -> None:
    # Qwen2.5-7B: 28 layers x 4 KV heads x 128 dims x (K, V) x 2 bytes.
    assert QWEN25_MATH_7B.kv_bytes_per_token == 57_344
    profile = Profile(
        name="t", source="", model=QWEN25_MATH_7B, hardware=H20, decode_efficiency=0.5, step_overhead_s=0.002
    )
    latency = profile.latency()
    bandwidth = H20.bandwidth * 0.5
    assert latency.base_s == pytest.approx(QWEN25_MATH_7B.weight_bytes / bandwidth + 0.002)
    assert latency.per_context_token_s == pytest.approx(57_344 / bandwidth)
    free = H20.memory_bytes * profile.memory_utilization - QWEN25_MATH_7B.weight_bytes
    assert latency.kv_capacity_tokens == int(free / 57_344)
    two = msgspec.structs.replace(
        profile, engine_gpus=2
    ).latency()  # tensor parallel: twice the bandwidth and memory
    assert two.per_context_token_s == pytest.approx(latency.per_context_token_s / 2)
    assert two.kv_capacity_tokens > 2 * latency.kv_capacity_tokens


def test_the_verl_trainer_phases_pass_through_the_paper_s_sync_rows() -> None:
    verl = PROFILES["verl-qwen2.5-math-7b-h20"]
    tokens, rows = verl.mean_tokens_per_step(), verl.prompts * verl.group
    for gpus, update, logprob in [(64, 133.41, 70.26), (128, 113.81, 53.92)]:
        assert verl.update.seconds(tokens, rows, gpus) == pytest.approx(update)
        assert verl.logprob.seconds(tokens, rows, gpus) == pytest.approx(logprob)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_shrunk_profile_keeps_every_step_s_time_per_gpu(name: str) -> None:
    profile = PROFILES[name]
    small = profile.shrunk(8)
    tokens, rows = profile.mean_tokens_per_step(), profile.prompts * profile.group
    assert small.prompts * 8 == profile.prompts and small.latency() == profile.latency()
    for phase, shrunk in [(profile.update, small.update), (profile.logprob, small.logprob)]:
        assert shrunk.seconds(tokens / 8, rows // 8, 16) == pytest.approx(phase.seconds(tokens, rows, 128))
    with pytest.raises(ValueError, match="do not divide"):
        profile.shrunk(7)


def test_other_lengths_keep_measured_phase_times_and_flop_costs_per_token() -> None:
    verl = PROFILES["verl-qwen2.5-math-7b-h20"]
    longer = verl.with_lengths(LogNormalLengths(median=4000, sigma=0.8, cap=28672))
    rows = verl.prompts * verl.group
    assert longer.mean_tokens_per_step() > verl.mean_tokens_per_step()
    assert longer.update.seconds(longer.mean_tokens_per_step(), rows, 128) == pytest.approx(
        verl.update.seconds(verl.mean_tokens_per_step(), rows, 128)
    )
    # AReaL publishes no phase times: its trainer is costed from FLOPs, so a token costs the
    # same at any lengths and fewer tokens train sooner.
    areal = PROFILES["areal-r1-distill-1.5b-h800"]
    shorter = areal.with_lengths(LogNormalLengths(median=2000, sigma=0.8, cap=27648))
    assert not areal.update.measured and shorter.update == areal.update
    assert shorter.update.seconds(shorter.mean_tokens_per_step(), rows, 128) < areal.update.seconds(
        areal.mean_tokens_per_step(), rows, 128
    )


def test_the_capped_log_normal_mean_matches_the_draws() -> None:
    lengths = LogNormalLengths(median=2000, sigma=1.0, cap=28672)
    rng = random.Random(1)
    draws = [lengths.draw(rng.randrange(1 << 30)) for _ in range(40_000)]
    # Draws truncate to whole tokens (-0.5 on average); the sampling error of 40,000 draws of
    # sigma ~ 3,500 is ~18 tokens: 5 of them is far outside chance.
    assert sum(draws) / len(draws) == pytest.approx(lengths_moment(lengths, 1) - 0.5, abs=5 * 3_500 / 200)
    assert lengths_moment(LogNormalLengths(median=10, sigma=0.0, cap=5), 1) == 5
    assert Phase(fixed_s=2, batch_rows=4, gpu_s_per_token=1.0).seconds(100, 2, 10) == pytest.approx(1 + 10)
