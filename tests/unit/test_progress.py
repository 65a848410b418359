"""``rlasync train``'s progress: plain lines for a log (every ten steps and each validation, with
the time left), a live rich display in a terminal with the warm-start's checks and then RL."""

from __future__ import annotations

import io

import pytest

from rlasync.metrics.progress import RunProgress

pytestmark = pytest.mark.unit


def _record(step: int, **extra: float) -> dict[str, float]:
    return {"step": step, "reward": 0.5, "rollout_s": 0.3, "train_s": 0.2, "response_tokens": 500, **extra}


def test_plain_lines_every_ten_steps_and_at_each_validation() -> None:
    out = io.StringIO()
    with RunProgress(steps=20, out=out) as progress:  # a StringIO is no terminal: plain
        assert not progress.live
        progress.warmstart(40, 300, 0.1, 0.3)  # the warm-start logs its own checks in a log
        progress.step({"step": 0, "val_accuracy": 0.25})
        for step in range(1, 21):
            progress.step(_record(step, **({"val_accuracy": 0.5} if step == 15 else {})))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["10/20", "15/20", "20/20"], lines
    assert "reward 0.500" in lines[0] and "1000 tokens/s" in lines[0] and "ETA" in lines[0]
    assert lines[1].endswith("val accuracy 0.500")


def test_a_terminal_gets_a_live_display_of_the_warm_start_then_rl() -> None:
    out = io.StringIO()
    with RunProgress(steps=4, out=out, live=True) as progress:  # a run stopped in its warm-start
        progress.warmstart(40, 300, 0.1, 0.45)
    assert "warm-start" in out.getvalue() and "40/300" in out.getvalue() and "greedy 0.450" in out.getvalue()
    out = io.StringIO()
    with RunProgress(steps=4, out=out, live=True) as progress:
        progress.warmstart(20, 300, 0.05, 0.2)
        progress.warmstart(40, 300, 0.1, 0.45)
        progress.step({"step": 0, "val_accuracy": 0.25})
        for step in range(1, 5):
            progress.step(_record(step))
    shown = out.getvalue()
    assert "RL" in shown and "4/4" in shown and "reward 0.500" in shown and "val 0.250" in shown, shown
    assert "warm-start" not in shown.splitlines()[-1]  # hidden once RL began
