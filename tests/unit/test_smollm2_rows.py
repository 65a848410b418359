"""The rows ``configs/smollm2_arith.yaml`` trains on (``examples/smollm2_arith.py``): no held-out
question is a training one in other words, and each row reads and scores as the config says."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from rlasync.config import load_config
from rlasync.data import load_rows
from rlasync.rewards import RewardInput, RewardOutput, get_reward

ROOT = Path(__file__).parents[2]


def _example() -> object:
    spec = importlib.util.spec_from_file_location("smollm2_arith", ROOT / "examples" / "smollm2_arith.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_pairs_are_never_trained_and_rows_score_as_configured(tmp_path: Path) -> None:
    train_count, val_count = _example().write_rows(tmp_path)  # type: ignore[attr-defined]
    assert (train_count, val_count) == (216, 72)
    config = load_config(ROOT / "configs" / "smollm2_arith.yaml")
    read = {
        split: load_rows(tmp_path / f"{split}.jsonl", answer_key=config.data.answer_key)
        for split in ("train", "val")
    }
    pairs = {
        split: {tuple(map(int, re.findall(r"\d+", r["messages"][0]["content"]))) for r in rows}
        for split, rows in read.items()
    }
    assert len(pairs["train"]) == 108 and len(pairs["val"]) == 36 and not pairs["train"] & pairs["val"]
    reward = get_reward(config.data.reward)

    def score(inp: RewardInput) -> float:
        out = reward(inp)
        return out.score if isinstance(out, RewardOutput) else float(out)

    for row in read["val"]:
        a, b = map(int, re.findall(r"\d+", row["messages"][0]["content"]))
        assert row["ground_truth"] == str(a * b)
        right = RewardInput(response_text=f"{a} x {b} = {a * b}", ground_truth=row["ground_truth"])
        wrong = RewardInput(response_text=f"The answer is {a * b + 1}.", ground_truth=row["ground_truth"])
        assert (score(right), score(wrong)) == (1.0, 0.0)
