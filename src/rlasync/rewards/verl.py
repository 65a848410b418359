"""verl's reward functions as rewards: a user's ``compute_score`` file
(``custom_reward_function.path``/``name``), and ``verl_default``, verl's scorer by data source.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)``, all by
keyword, with the row's ``data_source``, the response, ``reward_model.ground_truth`` as stored
(a list stays a list) and ``extra_info``; it may return a number, or a dict whose ``score`` is
the reward and whose other values are kept (verl's ``reward_extra_info``). So here: a row read
in verl's layout (``rlasync.data.load_rows``) keeps those fields, which reach a reward in
``RewardInput.extra``.
"""

from __future__ import annotations

import inspect
import numbers
import re
from pathlib import Path
from typing import Any

from .math_grader import response_matches
from .registry import RewardFn, RewardInput, RewardOutput, register_reward


class CustomRewardError(ValueError):
    """``custom_reward_function`` names no file or function, or one verl could not call."""


def load_compute_score(
    path: str, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None
) -> RewardFn:
    """The reward that calls ``name`` of the Python file ``path`` as verl does (see the module).
    The file is imported once per process (as a plugin); a missing file or function, or one that
    cannot take verl's arguments, is a ``CustomRewardError`` now."""
    from .. import plugins

    where = f"custom_reward_function (path={path!r}, name={name!r})"
    if not Path(path).expanduser().is_file():
        raise CustomRewardError(
            f"{where}: no such file (a relative path is taken from the directory rlasync runs in)"
        )
    try:
        module = plugins.load(path)
    except plugins.PluginError as exc:
        raise CustomRewardError(f"{where}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
        )
        raise CustomRewardError(
            f"{where}: the file defines no function {name!r} (it has {', '.join(defined) or 'none'})"
        )
    kwargs = dict(reward_kwargs or {})
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth="", extra_info={}, **kwargs)
    except TypeError as exc:
        raise CustomRewardError(
            f"{where}: {name}{inspect.signature(fn)} cannot be called as verl calls it, "
            f"{name}(data_source=, solution_str=, ground_truth=, extra_info={', **reward_kwargs' if kwargs else ''}) ({exc})"
        ) from None
    except ValueError:  # no signature to read (a builtin): its first call tells
        pass

    def arguments(inp: RewardInput) -> dict[str, Any]:
        reward_model = inp.extra.get("reward_model")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        return {
            "data_source": inp.extra.get("data_source"),
            "solution_str": inp.response_text,
            "ground_truth": inp.ground_truth if truth is None else truth,
            "extra_info": inp.extra.get("extra_info"),
            **kwargs,
        }

    if inspect.iscoroutinefunction(fn):

        async def compute_score_async(inp: RewardInput) -> RewardOutput:
            return verl_output(await fn(**arguments(inp)))

        reward: RewardFn = compute_score_async
    else:

        def compute_score(inp: RewardInput) -> RewardOutput:
            return verl_output(fn(**arguments(inp)))

        reward = compute_score
    reward.__name__ = reward.__qualname__ = name  # the name its failures are logged under
    return reward


def verl_output(result: Any) -> RewardOutput:
    """What a verl reward function returned, as ours: a number is the score; a dict's ``score``
    is, and its other numbers and strings are metrics."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a verl reward function's dict must hold 'score'; it held {sorted(result)}")
        metrics = {
            str(k): (float(v) if isinstance(v, numbers.Real) else v)
            for k, v in result.items()
            if k != "score" and isinstance(v, numbers.Real | str)
        }
        return RewardOutput(score=float(result["score"]), metrics=metrics)
    return RewardOutput(score=float(result))


# -- verl_default: verl's own scorer of a data source -----------------------------------------
_GSM8K = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_score(solution: str, truth: str) -> tuple[float, bool]:
    """verl's GSM8K rule (its ``strict`` method): in the solution's last 300 characters, the
    number after the last ``#### ``, commas dropped, equal to the ground truth as text."""
    found = _GSM8K.findall(solution[-300:])
    return float(bool(found) and found[-1].replace(",", "") == str(truth)), bool(found)


GSM8K_SOURCES = frozenset({"openai/gsm8k"})
MATH_SOURCES = frozenset(
    {
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math_dapo",
        "numina_aops_forum",
        "numina_synthetic_math",
        "numina_amc_aime",
        "numina_synthetic_amc",
        "numina_cn_k12",
        "numina_olympiads",
    }
)
"""The data sources verl scores as math (by the final answer's mathematical value)."""


@register_reward("verl_default")
def verl_default(inp: RewardInput) -> RewardOutput:
    """The score verl gives a row without a custom reward function, by its ``data_source``:
    GSM8K by its ``#### answer`` rule, the math sets by the answer's value (math-verify here).
    Another source is an error naming it (give ``custom_reward_function``)."""
    source = str(inp.extra.get("data_source") or "")
    if inp.ground_truth is None:
        raise ValueError("verl_default needs the row's reward_model.ground_truth")
    if source in GSM8K_SOURCES:
        score, found = gsm8k_score(inp.response_text, inp.ground_truth)
    elif source in MATH_SOURCES or source.startswith("aime"):
        right, found = response_matches(inp.ground_truth, inp.response_text)
        score = float(right)
    else:
        raise ValueError(
            f"verl_default has no scorer for data_source {source!r} (it knows {', '.join(sorted(GSM8K_SOURCES | MATH_SOURCES))}, aime*): "
            "give custom_reward_function.path"
        )
    return RewardOutput(score=score, metrics={"answer_found": float(found)})
