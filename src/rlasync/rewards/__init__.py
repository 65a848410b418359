"""Rewards: a registry of reward functions (sync or async) and the built-ins (no torch).

Score one trajectory with ``await compute_reward("boxed_math", RewardInput(...))``; it never
raises for the reward's failure (the error lands in ``metrics["error"]`` with a 0.0 score).
Add your own with ``@register_reward("name")`` in a module you import before training.
"""

from .builtin import (  # importing it registers the built-ins
    ToolFormat,
    exact_match,
    exact_numeric,
    extract_boxed,
    math_answers_equal,
    normalize_math_answer,
    parse_last_number,
    tool_format,
)
from .judge import JudgeError, LLMJudge
from .math_grader import answers_equal, boxed_math, math_verify, math_verify_installed
from .registry import (
    DEFAULT_TIMEOUT_S,
    RewardError,
    RewardFn,
    RewardInput,
    RewardOutput,
    compute_reward,
    factory_options,
    get_reward,
    make_reward,
    register_reward,
    register_reward_factory,
    registered_rewards,
)
from .reward_model import RewardModel
from .verl import CustomRewardError, load_compute_score, verl_default

register_reward_factory("llm_judge")(LLMJudge)
register_reward_factory("reward_model")(RewardModel)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CustomRewardError",
    "JudgeError",
    "LLMJudge",
    "RewardError",
    "RewardFn",
    "RewardInput",
    "RewardModel",
    "RewardOutput",
    "ToolFormat",
    "answers_equal",
    "boxed_math",
    "compute_reward",
    "exact_match",
    "exact_numeric",
    "extract_boxed",
    "factory_options",
    "get_reward",
    "load_compute_score",
    "make_reward",
    "math_answers_equal",
    "math_verify",
    "math_verify_installed",
    "normalize_math_answer",
    "parse_last_number",
    "register_reward",
    "register_reward_factory",
    "registered_rewards",
    "tool_format",
    "verl_default",
]
