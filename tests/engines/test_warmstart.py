"""Warm-start: SFT tokens are what the engine's episodes produce; a short run caches, replays, repeats."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlasync.agents import ChatTurns
from rlasync.compose import warmstart as ws
from rlasync.compose.warmstart import (
    WarmStartSettings,
    encode_sft,
    load_summary,
    run_episode,
    warm_start,
)
from rlasync.data import make_problems
from rlasync.engines import GenerateOutput, GenerateRequest
from rlasync.models import build_tokenizer, load_pretrained_dir

TINY = WarmStartSettings(
    batch_size=8,
    check_every=2,
    refine_every=0,
    max_steps=4,
    eval_problems=8,
    group_size=2,
    threshold=1.0,
    greedy_threshold=1.0,
)


class ReplayEngine:
    """Answers each turn with the next run of generated tokens of an SFT sequence, and checks
    that every prompt it is sent is exactly the SFT sequence up to there."""

    def __init__(self, ids: list[int], mask: list[int]) -> None:
        self.ids, self.mask = ids, mask

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        start = len(request.prompt_ids)
        assert request.prompt_ids == self.ids[:start] and self.mask[start] == 1
        end = start
        while end < len(self.mask) and self.mask[end]:
            end += 1
        out = self.ids[start:end]
        return GenerateOutput(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=out,
            logprobs=[0.0] * len(out),
            versions=[0] * len(out),
            finish_reason="stop",
        )


@pytest.mark.parametrize("task", ["reverse", "arith", "calc"])
def test_sft_tokens_are_exactly_an_episode_of_the_solution(task: str) -> None:
    tok = build_tokenizer()
    problem = make_problems(task, 1)[0]
    ids, mask = encode_sft(ChatTurns(tok), problem)
    generated = str(tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False))
    if task == "calc":  # the tool's response is the environment's: no loss on it
        assert generated.count("<tool_call>") == 1 and "<tool_response>" not in generated
    assert generated.endswith(f"{problem.answer}<|im_end|>")
    episode = asyncio.run(
        run_episode(ReplayEngine(ids, mask), tok, problem, temperature=1.0, seed=0, trajectory_id="r")
    )
    assert episode.prompt_ids + episode.response_ids == ids  # the agent loop's episode, token for token
    assert [0] * len(episode.prompt_ids) + episode.response_mask == mask
    assert episode.reward == 1.0 and episode.metrics.tool_calls == (task == "calc")
    assert episode.termination == "stop"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_short_warm_start_caches_and_the_same_seed_gives_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = torch.get_num_threads()
    path = warm_start("reverse", run_dir=tmp_path / "a", seed=3, settings=TINY)
    assert path.parent == tmp_path / "a" / "warmstart" and path.name.startswith("reverse-nano-seed3-")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary folder left
    summary = load_summary(path)
    assert (
        summary.steps == 4 and summary.stopped == "max_steps" and [c.step for c in summary.history] == [2, 4]
    )
    assert summary.group_accuracy is not None and summary.mixed_groups is not None
    assert torch.get_num_threads() == threads  # restored
    _, tok = load_pretrained_dir(path)
    assert tok.apply_chat_template([{"role": "user", "content": "Reverse abc"}], tokenize=False)

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained although the folder was cached")

    monkeypatch.setattr(ws, "_train", no_training)
    assert warm_start("reverse", run_dir=tmp_path / "a", seed=3, settings=TINY) == path
    monkeypatch.undo()

    again = warm_start("reverse", run_dir=tmp_path / "b", seed=3, settings=TINY)
    other = warm_start("reverse", run_dir=tmp_path / "b", seed=4, settings=TINY)
    assert again.name == path.name != other.name
    a, b, c = _weights(path), _weights(again), _weights(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert load_summary(again).history == summary.history


def test_meeting_the_threshold_replays_from_the_last_check_more_finely(tmp_path: Path) -> None:
    # Threshold 0: the first check (step 4) meets it; going back to step 0 and checking every
    # 2 steps stops at step 2, with the weights of a plain 2-step run.
    refined = warm_start(
        "arith",
        run_dir=tmp_path,
        settings=WarmStartSettings(
            **{**_fields(TINY), "threshold": 0.0, "check_every": 4, "refine_every": 2}
        ),
    )
    plain = warm_start(
        "arith", run_dir=tmp_path, settings=WarmStartSettings(**{**_fields(TINY), "max_steps": 2})
    )
    summary = load_summary(refined)
    assert (
        summary.stopped == "threshold" and summary.steps == 2 and [c.step for c in summary.history] == [4, 2]
    )
    a, b = _weights(refined), _weights(plain)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _fields(settings: WarmStartSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in settings.__struct_fields__}


async def test_called_from_an_event_loop_it_says_to_use_a_thread(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="to_thread"):
        warm_start("reverse", run_dir=tmp_path, settings=TINY)


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="warmstart.batch_size"):
        WarmStartSettings(batch_size=0)
    with pytest.raises(ValueError, match="thresholds"):
        WarmStartSettings(threshold=1.5)
