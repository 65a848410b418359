"""Task data: synthetic problems with answers, SFT targets and rewards (no torch)."""

from .synthetic import (
    TASKS,
    Problem,
    Task,
    calculator,
    get_task,
    iter_problems,
    make_problems,
    parse_tool_call,
    run_tool,
    split_of,
)

__all__ = [
    "TASKS", "Problem", "Task", "calculator", "get_task", "iter_problems", "make_problems", "parse_tool_call",
    "run_tool", "split_of",
]  # fmt: skip
