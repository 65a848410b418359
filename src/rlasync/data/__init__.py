"""Task data: dataset rows (JSONL, Parquet, saved ``datasets``), resumable samplers (a curriculum among them),
generators that add rows during a run, and synthetic problems with answers, SFT targets and
rewards (no torch)."""

from .datasets import DatasetError, Row, RowSampler, load_rows, synthetic_rows
from .generators import (
    DataGenerator,
    GeneratorError,
    RisingDifficulty,
    make_generator,
    register_generator,
    registered_generators,
)
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
    "DataGenerator",
    "DatasetError",
    "GeneratorError",
    "PassRateSampler",
    "Problem",
    "RisingDifficulty",
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
    "make_generator",
    "make_problems",
    "make_sampler",
    "register_generator",
    "register_sampler",
    "registered_generators",
    "registered_samplers",
    "split_of",
    "synthetic_rows",
]
