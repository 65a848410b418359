"""Task data: dataset rows (JSONL, Parquet, saved ``datasets``), resumable samplers (a curriculum among them), and
synthetic problems with answers, SFT targets and rewards (no torch)."""

from .datasets import DatasetError, Row, RowSampler, load_rows, synthetic_rows
from .samplers import (
    PassRateSampler,
    RowResult,
    Sampler,
    SamplerError,
    UniformSampler,
    make_sampler,
    register_sampler,
    registered_samplers,
)
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
    "PassRateSampler",
    "Problem",
    "Row",
    "RowResult",
    "RowSampler",
    "Sampler",
    "SamplerError",
    "Task",
    "UniformSampler",
    "get_task",
    "iter_problems",
    "load_rows",
    "loop_reward",
    "make_problems",
    "make_sampler",
    "register_sampler",
    "registered_samplers",
    "split_of",
    "synthetic_rows",
]
