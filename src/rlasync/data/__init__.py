"""Task data: dataset rows (JSONL, Parquet, saved ``datasets``), a resumable sampler, and
synthetic problems with answers, SFT targets and rewards (no torch)."""

from .datasets import DatasetError, Row, RowSampler, load_rows, synthetic_rows
from .synthetic import (
    TASKS,
    Problem,
    Task,
    get_task,
    iter_problems,
    loop_reward,
    make_problems,
    split_of,
)

__all__ = [
    "TASKS",
    "DatasetError",
    "Problem",
    "Row",
    "RowSampler",
    "Task",
    "get_task",
    "iter_problems",
    "load_rows",
    "loop_reward",
    "make_problems",
    "split_of",
    "synthetic_rows",
]
