"""The ``data/rows`` ledger of a run: which row uses it trained, and which an uninterrupted run
of its config trains. A run stopped (killed, interrupted, preempted) and resumed must train
exactly those: none lost, none twice."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from rlasync.config import load_config
from rlasync.data import RowSampler, synthetic_rows


def trained_uses(run_dir: Path) -> collections.Counter[tuple[int, int]]:
    """The ``[epoch, row]`` uses ``run_dir/metrics.jsonl`` records as trained."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return collections.Counter(tuple(use) for r in records for use in r.get("data/rows", []))


def uninterrupted_uses(config: Path, overrides: list[str]) -> collections.Counter[tuple[int, int]]:
    """What an uninterrupted run of ``config`` with ``overrides`` trains: its sampler's first
    ``train.steps * train.prompts_per_step`` row uses."""
    cfg = load_config(config, overrides)
    rows = synthetic_rows(
        cfg.train.task, cfg.data.synthetic_train_size, seed=cfg.train.seed, split="train", distinct=False
    )
    sampler = RowSampler(rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    return collections.Counter(sampler.next_uses(cfg.train.steps * cfg.train.prompts_per_step))
