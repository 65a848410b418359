"""Rewards: a registry of reward functions (sync or async) and the built-ins (no torch).

Score one trajectory with ``await compute_reward("boxed_math", RewardInput(...))``; it never
raises for the reward's failure (the error lands in ``metrics["error"]`` with a 0.0 score).
Add your own with ``@register_reward("name")`` in a module you import before training.
"""

from .builtin import (  # importing it registers the built-ins
    ToolFormat,
    boxed_math,
    exact_match,
    exact_numeric,
    extract_boxed,
    math_answers_equal,
    normalize_math_answer,
    parse_last_number,
    tool_format,
)
from .registry import (
    DEFAULT_TIMEOUT_S,
    RewardError,
    RewardFn,
    RewardInput,
    RewardOutput,
    compute_reward,
    get_reward,
    register_reward,
    registered_rewards,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RewardError",
    "RewardFn",
    "RewardInput",
    "RewardOutput",
    "ToolFormat",
    "boxed_math",
    "compute_reward",
    "exact_match",
    "exact_numeric",
    "extract_boxed",
    "get_reward",
    "math_answers_equal",
    "normalize_math_answer",
    "parse_last_number",
    "register_reward",
    "registered_rewards",
    "tool_format",
]
