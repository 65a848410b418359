"""verifiers environments (the classic API the Environments Hub's are written in), unchanged.

    data:
      source:
        verifiers:
          env: vf_gsm8k            # a module with load_environment(**args), or a .py file
          args: {num_train_examples: 2000}

The environment's ``load_environment(**args)`` builds it (a ``SingleTurnEnv``, ``MultiTurnEnv``,
``ToolEnv``...). Its dataset gives the training rows and its eval dataset the held-out rows
(verifiers falls back to the training rows, with a warning, when it has none). Each trajectory
is the environment's own ``rollout`` (its ``env_response`` turns, its tools, its stop
conditions) against an OpenAI client of the run's endpoint that records every call with its
tokens, then its ``Rubric`` scores it: the weighted sum of its reward functions is the reward.
So the environment sees messages, and the trajectory keeps the tokens the model sampled.

A rubric with group-level reward functions (those that take ``completions``, ``states``...: a
whole group of rollouts at once, a diversity bonus or a pairwise judge) scores each prompt's
group together once all its rollouts are done (``Environment.score_group``, called by the
agent-loop worker, which holds a group: ``train.group_size`` copies of a prompt), its
individual functions alongside, weighted as the rubric says. Needs ``pip install 'rlasync[envs-frameworks]'``
(verifiers' classic API: 0.3.x; 0.4 has only its new ``verifiers.v1`` stack).
"""

from __future__ import annotations

import collections
from typing import Any

from ..data import Row
from ..rewards import RewardOutput
from .base import EnvError, Environment, MissingExtraError, Split, import_extra, register_environment

MODEL = "policy"
"""The model name the environment's calls carry (the run's endpoint serves its policy under any)."""
MAX_UNSCORED = 65536
"""Rollouts kept for their group's scoring at most (far more than a node runs at once)."""


def _package() -> Any:
    verifiers = import_extra(
        "verifiers", setting="data.source.verifiers", package="verifiers (0.3.x)", extra="envs-frameworks"
    )
    if not hasattr(verifiers, "SingleTurnEnv"):
        raise MissingExtraError(
            f"data.source.verifiers needs verifiers' classic environment API (0.3.x); {verifiers.__version__} "
            "has only verifiers.v1: pip install 'verifiers>=0.3.1,<0.4'"
        )
    _keep_our_signal_handlers()
    return verifiers


class _NoHandlers:
    """``signal`` as verifiers' environment module sees it: everything but ``signal.signal``."""

    def __getattr__(self, name: str) -> Any:
        import signal

        return getattr(signal, name)

    @staticmethod
    def signal(signalnum: int, handler: Any) -> Any:
        return None


def _keep_our_signal_handlers() -> None:
    """Each verifiers ``Environment`` installs SIGINT and SIGTERM handlers as it is built (SIGTERM:
    ``exit(143)`` at once), which would replace the run's own (``rlasync.interrupts``: stop at a
    step's end, checkpoint, tell the nodes), and fails outright off the main thread, where a
    worker builds it. Its module gets a ``signal`` without ``signal.signal``; what those handlers
    would tear down, ``close`` does."""
    from verifiers.legacy.envs import environment

    environment.signal = _NoHandlers()


@register_environment("verifiers")
class Verifiers(Environment):
    """A verifiers environment (see the module docstring): ``env`` names its module (or a .py
    file), ``args`` its ``load_environment`` arguments; ``size`` caps the training rows."""

    def __init__(self, *, seed: int, env: str, args: dict[str, Any] | None = None, size: int = 0) -> None:
        vf = _package()
        self.name, self.seed, self.size = env, int(seed), size
        self.env = _load(vf, env, dict(args or {}))
        self.group_functions = _group_functions(self.env.rubric)
        # uid -> a finished rollout's state, until its group is scored; bounded, as a trajectory
        # whose group is never scored (its worker call cut by a lost node) leaves its state here
        self._unscored: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._client_of = vf.OpenAIChatCompletionsClient

    async def close(self) -> None:
        await self.env._teardown()

    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        n = n if n is not None else (self.size or -1)
        dataset = self.env.get_dataset(n) if split == "train" else self.env.get_eval_dataset(n)
        return [self._row(record, split, i) for i, record in enumerate(dataset)]

    def _row(self, record: dict[str, Any], split: Split, position: int) -> Row:
        messages = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in record["prompt"]]
        # The record as the environment's rollout takes it (its answer, info, example id and any
        # column of its own), less the prompt, which is the row's messages.
        vf_input = {k: v for k, v in record.items() if k != "prompt" and v is not None}
        example_id = vf_input.setdefault("example_id", position)
        row: Row = {
            "messages": messages,
            "uid": f"{self.name}:{split}:{example_id}",
            "agent_name": "environment",
            "verifiers_input": vf_input,
            "kind": split,
        }
        if vf_input.get("answer"):
            row["ground_truth"] = str(vf_input["answer"])
        return row

    async def converse(self, client: Any, row: Row) -> RewardOutput:
        vf_input = dict(row["verifiers_input"], prompt=row["messages"])
        # Its author's sampling settings (a forced tool_choice, say), as verifiers' own runs use them;
        # what they leave out is the run's (the endpoint's recording fills it in).
        sampling = dict(getattr(self.env, "sampling_args", None) or {})
        state = await self.env.rollout(vf_input, self._client_of(client), MODEL, sampling)
        if state.get("error") is not None:  # the rollout caught it (a vf.Error): not a score
            raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
        if self.group_functions:  # scored with its group (score_group), once the group is done
            self._unscored[str(row["uid"])] = state
            while len(self._unscored) > MAX_UNSCORED:
                self._unscored.popitem(last=False)
            return RewardOutput(score=0.0, metrics={})
        await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        return _reward(state)

    async def score_group(self, uids: list[str]) -> dict[str, RewardOutput]:
        states = {uid: state for uid in uids if (state := self._unscored.pop(uid, None)) is not None}
        if not states:  # no group functions, or every rollout of the group failed
            return {}
        await self.env.rubric.score_group(list(states.values()))
        for state in states.values():
            await self.env.rubric.cleanup(state)
        return {uid: _reward(state) for uid, state in states.items()}


def _reward(state: Any) -> RewardOutput:
    """A scored rollout's reward, with its functions' values as metrics."""
    metrics: dict[str, float | str] = {
        str(k): float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, int | float)
    }
    return RewardOutput(score=float(state["reward"]), metrics=metrics)


def _group_functions(rubric: Any) -> list[str]:
    """The group-level reward functions of a rubric and of the rubrics it groups."""
    if hasattr(rubric, "rubrics"):  # a RubricGroup (the environment's with its monitors, at least)
        return [name for sub in rubric.rubrics for name in _group_functions(sub)]
    return [getattr(f, "__name__", repr(f)) for f in rubric._get_group_reward_funcs()]


def _load(vf: Any, env: str, args: dict[str, Any]) -> Any:
    """``load_environment(**args)`` of the module ``env`` (an installed module or env id, or a
    .py file, imported as a plugin)."""
    from .. import plugins

    where = f"data.source.verifiers.env={env!r}"
    if plugins.is_file(env):
        try:
            module = plugins.load(env)
        except plugins.PluginError as exc:
            raise EnvError(f"{where}: {exc}") from None
        load = getattr(module, "load_environment", None)
        if load is None:
            raise EnvError(f"{where}: the file defines no load_environment(**kwargs)")
        built = load(**args)
    else:
        try:
            built = vf.load_environment(env, **args)
        except (ImportError, AttributeError, ValueError) as exc:
            raise EnvError(f"{where}: {exc}") from None
    if not isinstance(built, vf.Environment):
        raise EnvError(
            f"{where}: load_environment returned {type(built).__name__}, not a verifiers Environment"
        )
    return built
