"""The LLM judge (``data.reward: {llm_judge: {...}}``): verdicts parsed from a real model's
replies (``rlasync serve``), a judge that answers garbage or never answers scores 0 with the
error counted (``reward/errors``) and never holds a step past its timeout, and the same prompt
judged once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rlasync.rewards import JudgeError, LLMJudge, RewardInput, compute_reward, make_reward

pytestmark = pytest.mark.timeout(600)


def test_verdicts_are_parsed_and_anything_else_is_an_error() -> None:
    score = LLMJudge(url="http://x/v1")
    assert score.parse("Reasoning... Score: 7") == 0.7
    assert score.parse("score = 12") == 1.0 and score.parse(" 3 ") == 0.3  # clipped; a bare number
    yes_no = LLMJudge(url="http://x/v1", verdict="yes_no")
    assert yes_no.parse("Yes, it is.") == 1.0 and yes_no.parse("**No**") == 0.0
    for judge, reply in ((score, "it is 7 out of 10"), (yes_no, "maybe")):
        with pytest.raises(JudgeError):
            judge.parse(reply)


def test_a_judge_is_a_reward_built_from_the_config_and_its_mistakes_are_named() -> None:
    judge = make_reward({"llm_judge": {"url": "http://x/v1", "timeout_s": 5}})
    assert isinstance(judge, LLMJudge) and judge.timeout_s == 5
    assert isinstance(make_reward({"name": "llm_judge", "url": "http://x/v1"}), LLMJudge)
    with pytest.raises(ValueError, match=r"no reward factory named 'judge'"):
        make_reward({"judge": {"url": "u"}})
    with pytest.raises(ValueError, match=r"data.reward.llm_judge: .*colour"):
        make_reward({"llm_judge": {"url": "u", "colour": 1}})
    with pytest.raises(ValueError, match=r"llm_judge.prompt: KeyError\('answer'\)"):
        make_reward({"llm_judge": {"url": "u", "prompt": "Grade {answer}"}})


@contextlib.contextmanager
def served(model: Path) -> Iterator[str]:
    """``rlasync serve MODEL`` on a free port; its URL."""
    server = subprocess.Popen(
        [sys.executable, "-m", "rlasync", "serve", str(model), "--port", "0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stderr is not None
        for line in server.stderr:
            if (found := re.search(r"serving '.*' at (http://\S+/v1)", line)) is not None:
                yield found.group(1)
                return
        raise AssertionError(f"rlasync serve exited with {server.wait()} before serving")
    finally:
        server.terminate()
        server.wait(timeout=60)


@contextlib.asynccontextmanager
async def silent_judge() -> AsyncIterator[str]:
    """An address that takes connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        for writer in held:
            writer.close()
        server.close()


async def test_a_judge_that_never_answers_scores_0_at_its_timeout() -> None:
    async with silent_judge() as url:
        judge = LLMJudge(url=url, model="m", timeout_s=1.0)
        out = await compute_reward(judge, RewardInput(response_text="42", ground_truth="42"), timeout_s=30)
    assert out.score == 0.0 and str(out.metrics["error"]).startswith("TimeoutError"), out


def test_a_real_model_judges_and_the_same_prompt_is_judged_once() -> None:
    from rlasync.models import smollm2_dir

    with served(smollm2_dir()) as url:
        judge = LLMJudge(
            url=url,
            verdict="yes_no",
            prompt="Is {response} the word {ground_truth} spelled backwards? Answer yes or no.",
            max_tokens=4,
        )

        async def judge_twice() -> list[float]:
            first = await compute_reward(judge, RewardInput(response_text="cba", ground_truth="abc"))
            again = await compute_reward(judge, RewardInput(response_text="cba", ground_truth="abc"))
            assert "error" not in first.metrics and again.metrics["judge_cached"] == 1.0
            return [first.score, again.score]

        scores = asyncio.run(judge_twice())
    assert scores[0] in (0.0, 1.0) and scores[0] == scores[1] and judge.calls == 1


CONFIG = """\
train:
  model_dir: {model}
  run_dir: {run_dir}
  steps: 2
  prompts_per_step: 2
  group_size: 2
  max_new_tokens: 8
  validate_every: 1000
  val_size: 2
  fail_on_reward_errors: 0
trainer:
  lr: 1.0e-4
engine:
  max_batch: 16
data:
  train_files: [rows.jsonl]
  val_files: [rows.jsonl]
  reward: {{llm_judge: {{url: "{url}", timeout_s: {timeout}, retries: 0}}}}
"""


@pytest.mark.parametrize("judge", ["garbage", "silent"])
def test_a_broken_judge_scores_0_with_the_errors_counted_and_the_run_goes_on(
    tmp_path: Path, nano_model_dir: Path, judge: str
) -> None:
    (tmp_path / "rows.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"Reverse {w}", "ground_truth": w[::-1]}) + "\n" for w in ["abc", "dog"]
        )
    )

    def train(url: str) -> subprocess.CompletedProcess[str]:
        config = CONFIG.format(model=nano_model_dir, run_dir=tmp_path / "run", url=url, timeout=2)
        (tmp_path / "run.yaml").write_text(config)
        return subprocess.run(
            [sys.executable, "-m", "rlasync", "train", "run.yaml"],
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp_path,
        )

    if judge == "garbage":  # the micro model, untrained, as the judge: no verdict in what it says
        with served(nano_model_dir) as url:
            done = train(url)
        expected = "holds no 'Score: <number>'"
    else:
        held = subprocess.Popen(  # a judge that takes the connection and never answers
            [sys.executable, "-c", SILENT], stdout=subprocess.PIPE, text=True
        )
        try:
            assert held.stdout is not None
            done = train(held.stdout.readline().strip())
        finally:
            held.kill()
            held.wait()
        expected = "TimeoutError"
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert [r["reward"] for r in steps] == [0.0, 0.0]
    assert steps[-1]["reward/errors"] == 8  # 2 steps x 2 prompts x 2 samples, each counted
    assert expected in done.stderr  # the reward's failure, said once in the log


SILENT = """\
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(64)
print(f"http://127.0.0.1:{s.getsockname()[1]}/v1", flush=True)
held = []
while True:
    held.append(s.accept())
"""
