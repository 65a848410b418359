"""Supervised warm-start on a synthetic task, so RL starts from a policy that emits the
format but is often wrong; cached under the run directory.

    path = warm_start("calc", run_dir="runs/quick", seed=0)   # ~1 min on 2 cores, then cached
    model, tokenizer = load_pretrained_dir(path)

It builds a tiny model (``build_tiny_lm``) and trains it on correct solutions, tokenised as
an agent loop tokenises a trajectory (``ChatTurns``), with loss only on the tokens the model
itself generates (not the prompt, not tool responses). Every ``check_every`` steps it
measures accuracy on fixed validation problems with the torch engine and the episode RL runs
(``ToolAgentLoop``: the Hermes parser, the calculator for ``calc``), sampled (temperature 1)
and greedy, and stops once either reaches its threshold. A fixed step count is fragile:
these tasks learn through a sharp phase transition whose timing depends on the data order,
and accuracy can go from 0 to 0.6 between two checks, so the check that crosses a threshold
sends training back to the check before, to replay the same batches checking every
``refine_every`` steps. The folder,
``<run_dir>/warmstart/<task>-<preset>-seed<seed>-<hash of the settings>/``, holds the model
and ``warmstart.json`` (a ``WarmStartSummary``); it is written under a temporary name and
renamed, so a folder that exists is complete and is returned without training.

Deterministic for a seed: initial weights, data order, and every evaluation sample
(per-request seeds) follow from it, so the stopping step does too; wall time does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..agents import ChatTurns, ToolAgentLoop, Trajectory
from ..config import AgentConfig
from ..data.synthetic import Problem, get_task, iter_problems, loop_reward, make_problems
from ..engines import SamplingParams, TorchEngine
from ..models import TinyLMConfig, build_tiny_lm, save_pretrained_dir
from ..tools import build_tools

log = logging.getLogger(__name__)

VERSION = 3
"""Part of the cache key: bump when the data, the loss or the evaluation changes meaning."""
EVAL_SEED = 0
"""Seed of the fixed validation problems every warm-start is checked on (whatever its own seed)."""
SUMMARY = "warmstart.json"


class WarmStartSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a warm-start trains and when it stops (all part of the cache key)."""

    lr: float = 3e-3
    """AdamW learning rate, constant (betas 0.9/0.99, no weight decay, gradient norm clipped at 1)."""
    batch_size: int = 64
    """Problems per step (one SFT sequence each)."""
    threshold: float = 0.15
    """Stop at the first check whose sampled accuracy (temperature 1) is at least this."""
    greedy_threshold: float = 0.5
    """…or whose greedy accuracy is at least this: a policy that knows the rule but is unsure
    of it reaches high greedy accuracy while its samples are still mostly wrong."""
    check_every: int = 20
    """Steps between accuracy checks; a check costs about as much as a few steps."""
    refine_every: int = 2
    """Once a check meets a threshold, go back to the previous check and replay the same steps
    checking this often (0: stop at once)."""
    max_steps: int = 600
    """Stop here even below the threshold (the summary says so)."""
    eval_problems: int = 64
    """Fixed validation problems every check samples one episode for."""
    group_size: int = 8
    """At the end, episodes per validation problem for ``mixed_groups`` (0 skips it)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "check_every", "max_steps", "eval_problems"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmstart.{name}: expected a positive integer, got {getattr(self, name)}")
        if (
            not (0.0 <= self.threshold <= 1.0 and 0.0 <= self.greedy_threshold <= 1.0)
            or self.lr <= 0
            or min(self.group_size, self.refine_every) < 0
        ):
            raise ValueError(
                "warmstart: expected thresholds in [0, 1], lr > 0, group_size >= 0 and refine_every >= 0"
            )


WARMSTART_PROGRESS: ContextVar[Callable[[int, int, float, float], None] | None] = ContextVar(
    "rlasync_warmstart_progress", default=None
)
"""Called at each check of a warm-start run in this context (``rlasync train``'s progress
display): ``(step, max_steps, sampled accuracy, greedy accuracy)``. A context variable, so the
thread a run warm-starts in (``asyncio.to_thread`` copies the context) reports without every
layer between the command line and the warm-start passing it down."""


DEFAULT_SETTINGS: dict[str, WarmStartSettings] = {
    "reverse": WarmStartSettings(lr=1e-3),
    # At lr 3e-3 two of three seeds stalled at loss ~0.9 (one hit 600 steps at 0.06).
    "arith": WarmStartSettings(lr=1e-3),
    # Sequences are ~5x longer (tool schema, call, response): half the batch.
    "calc": WarmStartSettings(batch_size=32, max_steps=1200),
}
"""Measured on 2 busy cores (one thread; reverse with the quickstart's greedy threshold 0.4):
reverse seeds 0–4 stop after 60–114 steps (15–50 s) with sampled accuracy 0.02–0.27, greedy
0.16–0.58 and 30–73 % of validation problems giving a GRPO group of 8 both rewards
(``mixed_groups``); calc seed 0 after 142 steps with sampled 0.25, greedy 0.72 (calc's greedy
runs ahead: one wrong token in its 25-token tool call fails a sample) on an AVX2 CPU, but only
after 550–600 on an AVX-512 Xeon (the kernels' rounding moves its phase transition: greedy 0
up to step 450, 0.28 at 550, 0.61 at 600), hence calc's cap of 1,200 steps."""


class Check(msgspec.Struct, frozen=True, array_like=True):
    step: int
    loss: float  # mean over the steps since the previous check
    sampled_accuracy: float
    greedy_accuracy: float


class WarmStartSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What ``warmstart.json`` records."""

    task: str
    preset: str
    seed: int
    settings: WarmStartSettings
    steps: int
    seconds: float
    """Wall time of training and checks (not of saving); varies with machine load."""
    stopped: Literal["threshold", "max_steps"]
    sampled_accuracy: float
    """At the last check: one temperature-1 episode per validation problem."""
    greedy_accuracy: float
    """At the last check: the greedy episode of each validation problem."""
    group_accuracy: float | None
    """Mean reward of ``group_size`` temperature-1 episodes per validation problem."""
    mixed_groups: float | None
    """Share of validation problems whose group has both a right and a wrong episode: the ones
    that give GRPO a gradient (zero-variance groups give none)."""
    tool_use: float
    """Share of the greedy episodes that called a tool."""
    history: list[Check]


# -- tokens ---------------------------------------------------------------------------------
def encode_sft(turns: ChatTurns, problem: Problem) -> tuple[list[int], list[int]]:
    """The token ids of prompt + solution, and a mask (1) of the tokens the model generates.

    Built the way an agent loop builds a trajectory (``ChatTurns``): the prompt, each assistant
    turn as the model says it (up to and including its end token), and between them what the
    environment appends (the turn separator, tool responses, the next assistant header), so
    the solution's ids are exactly what the model would produce in an episode.
    """
    ids = turns.prompt_ids(problem.messages, problem.tools)
    mask = [0] * len(ids)
    conversation = list(problem.messages)
    environment: list[dict[str, Any]] = []
    for message in problem.target:
        if message["role"] != "assistant":
            environment.append(message)
            continue
        if environment:
            new = turns.after_model_turn(environment)
            ids, mask = ids + new, mask + [0] * len(new)
            conversation += environment
            environment = []
        new = turns.model_turn(conversation, message, problem.tools)
        ids, mask = ids + new, mask + [1] * len(new)
        conversation.append(message)
    if environment:
        raise ValueError(f"{problem.task} {problem.key!r}: the solution must end with an assistant turn")
    return ids, mask


# -- episodes -------------------------------------------------------------------------------
MAX_TURNS = 3
"""Assistant turns of an episode: the calc solution takes two (the call, the answer)."""


async def run_episode(
    engine: Any, tokenizer: Any, problem: Problem, *, temperature: float, seed: int, trajectory_id: str
) -> Trajectory:
    """One episode of ``problem`` as RL runs it: the tool agent loop with the Hermes parser and,
    for ``calc``, the calculator; rewarded by the task (the ``problem`` row field)."""
    tools = build_tools(["calculator"]) if problem.tools else {}
    loop = ToolAgentLoop(
        engine,
        tokenizer,
        AgentConfig(tools=sorted(tools), max_assistant_turns=MAX_TURNS),
        tools=tools,
        reward_fn=loop_reward(problem.task),
        trajectory_id=trajectory_id,
    )
    params = SamplingParams(
        temperature=temperature, max_new_tokens=get_task(problem.task).max_new_tokens, seed=seed
    )
    return await loop.run(params, messages=problem.messages, problem=problem)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


async def _rollouts(
    model: Any,
    tokenizer: Any,
    problems: list[Problem],
    *,
    temperature: float,
    seed: int,
    samples: int,
    name: str,
) -> list[list[Trajectory]]:
    engine = TorchEngine(model, max_batch=128, seed=seed)
    try:
        flat = await asyncio.gather(
            *[
                run_episode(
                    engine, tokenizer, p, temperature=temperature, seed=seed, trajectory_id=f"{name}.{i}.{j}"
                )
                for i, p in enumerate(problems)
                for j in range(samples)
            ]
        )
    finally:
        await engine.close()
    return [flat[i * samples : (i + 1) * samples] for i in range(len(problems))]


def evaluate(
    model: Any,
    tokenizer: Any,
    problems: list[Problem],
    *,
    temperature: float,
    seed: int,
    samples: int = 1,
    name: str = "eval",
) -> list[list[Trajectory]]:
    """``samples`` episodes per problem with a fresh torch engine (runs its own event loop); each
    turn's sampling seed follows from ``seed``, ``name`` and the episode's place."""
    was_training = model.training
    try:
        return asyncio.run(
            _rollouts(
                model, tokenizer, problems, temperature=temperature, seed=seed, samples=samples, name=name
            )
        )
    finally:
        model.train(was_training)


# -- training -------------------------------------------------------------------------------
def sft_batch(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[Any, Any]:
    """``encode_sft`` rows as one right-padded batch (positions 0.. as in generation): input ids,
    and labels (-100: no loss)."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (x, m) in enumerate(rows):
        ids[r, : len(x)] = torch.tensor(x)
        labels[r, : len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(x), -100)
    return ids, labels


def sft_step(model: Any, optimizer: Any, ids: Any, labels: Any) -> float:
    """One supervised step on a batch (``sft_batch``): next-token cross-entropy on the labelled
    tokens, the gradient norm clipped at 1; the loss."""
    import torch
    import torch.nn.functional as F

    # Right padding: real tokens never attend to the padding after them, so no attention mask is
    # needed, and positions count from 0 exactly as when the engine generates.
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.item())


def _batches(tokenizer: Any, task: str, seed: int, batch_size: int) -> Iterator[tuple[Any, Any]]:
    """The task's training problems as ``sft_batch`` batches, endlessly."""
    turns = ChatTurns(tokenizer)
    cache: dict[str, tuple[list[int], list[int]]] = {}
    problems = iter_problems(task, seed=seed, split="train")
    while True:
        rows = []
        for _ in range(batch_size):
            p = next(problems)
            if p.key not in cache:
                cache[p.key] = encode_sft(turns, p)
            rows.append(cache[p.key])
        yield sft_batch(rows, tokenizer.pad_token_id)


def _train(
    task: str, model: Any, tokenizer: Any, preset: str, seed: int, settings: WarmStartSettings
) -> WarmStartSummary:
    """SFT until a check meets a threshold. When one does, go back to the previous check's
    state and replay the same batches checking every ``refine_every`` steps, to stop near the
    first step that meets it: the accuracy can jump from 0 to 0.6 between two checks."""
    import torch

    problems = make_problems(task, settings.eval_problems, seed=EVAL_SEED, split="val")
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
    batches: Iterator[tuple[Any, Any]] = _batches(tokenizer, task, seed, settings.batch_size)
    saved = (0, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    since_saved: list[tuple[Any, Any]] = []  # the batches trained on since `saved`, to replay
    every = settings.check_every
    history: list[Check] = []
    losses: list[float] = []
    start = time.monotonic()
    stopped: Literal["threshold", "max_steps"] = "max_steps"
    step = 0
    model.train()
    while step < settings.max_steps:
        step += 1
        batch = next(batches)
        since_saved.append(batch)
        losses.append(sft_step(model, optimizer, *batch))
        if step % every and step < settings.max_steps:
            continue
        sampled = [
            e[0] for e in evaluate(model, tokenizer, problems, temperature=1.0, seed=seed, name="sampled")
        ]
        greedy = [e[0] for e in evaluate(model, tokenizer, problems, temperature=0.0, seed=0, name="greedy")]
        check = Check(
            step=step,
            loss=_mean(losses),
            sampled_accuracy=_mean(e.reward for e in sampled),
            greedy_accuracy=_mean(e.reward for e in greedy),
        )
        history.append(check)
        losses.clear()
        report = WARMSTART_PROGRESS.get()
        if report is not None:
            report(step, settings.max_steps, check.sampled_accuracy, check.greedy_accuracy)
        log.info(
            "warm-start %s seed %d: step %d loss %.4f accuracy sampled %.3f greedy %.3f (%.0f s)",
            task,
            seed,
            step,
            check.loss,
            check.sampled_accuracy,
            check.greedy_accuracy,
            time.monotonic() - start,
        )
        if check.sampled_accuracy < settings.threshold and check.greedy_accuracy < settings.greedy_threshold:
            saved = (step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
            since_saved = []
        elif every > settings.refine_every > 0 and len(since_saved) > settings.refine_every:
            log.info(
                "warm-start %s seed %d: back to step %d, checking every %d steps",
                task,
                seed,
                saved[0],
                settings.refine_every,
            )
            step, model_state, optimizer_state = saved
            model.load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)
            batches, since_saved, every = itertools.chain(since_saved, batches), [], settings.refine_every
        else:
            stopped = "threshold"
            break
    model.eval()
    group_accuracy = mixed = None
    if settings.group_size:
        groups = evaluate(
            model, tokenizer, problems, temperature=1.0, seed=seed, samples=settings.group_size, name="group"
        )
        rewards = [[e.reward for e in g] for g in groups]
        group_accuracy = sum(map(sum, rewards)) / (len(rewards) * settings.group_size)
        mixed = sum(0 < sum(r) < len(r) for r in rewards) / len(rewards)
    return WarmStartSummary(
        task=task,
        preset=preset,
        seed=seed,
        settings=settings,
        steps=step,
        seconds=round(time.monotonic() - start, 2),
        stopped=stopped,
        sampled_accuracy=history[-1].sampled_accuracy,
        greedy_accuracy=history[-1].greedy_accuracy,
        group_accuracy=group_accuracy,
        mixed_groups=mixed,
        tool_use=_mean(e.metrics.tool_calls > 0 for e in greedy),
        history=history,
    )


@contextlib.contextmanager
def _deterministic(seed: int, threads: int | None) -> Iterator[None]:
    """Seeded torch RNG, deterministic kernels, a thread count: all restored afterwards (they are global)."""
    import torch

    before, threads_before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True)
        if threads:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before)
            torch.set_num_threads(threads_before)


def cache_name(task: str, preset: str, seed: int, settings: WarmStartSettings) -> str:
    key = msgspec.json.encode(
        {"version": VERSION, "task": task, "preset": preset, "seed": seed, "settings": settings}
    )
    return f"{task}-{preset}-seed{seed}-{hashlib.sha256(key).hexdigest()[:8]}"


def warm_start(
    task: str,
    *,
    run_dir: str | os.PathLike[str],
    preset: str = "nano",
    seed: int = 0,
    settings: WarmStartSettings | None = None,
    threads: int | None = 1,
) -> Path:
    """The folder of a warm-started model for ``task`` (trained now, or found in the cache).

    ``threads`` caps torch's intra-op threads while training (restored after; None leaves
    them): at these sizes one thread is about as fast as two on an idle 2-core machine and
    many times faster on a busy one (OpenMP threads spin against other processes), and it
    keeps the arithmetic, hence the stopping step, the same on any machine.
    Blocking (minutes of CPU): from async code, call it in a thread with
    ``await asyncio.to_thread(warm_start, …)``.
    """
    get_task(task)
    settings = settings or DEFAULT_SETTINGS[task]
    parent = Path(run_dir) / "warmstart"
    final = parent / cache_name(task, preset, seed, settings)
    if (final / SUMMARY).is_file():
        log.info("warm-start %s seed %d: cached at %s", task, seed, final)
        return final
    if _loop_running():
        raise RuntimeError(
            "warm_start blocks for minutes and runs its own event loop: call it in a thread, `await asyncio.to_thread(warm_start, ...)`"
        )
    parent.mkdir(parents=True, exist_ok=True)
    with _deterministic(seed, threads):
        model, tokenizer = build_tiny_lm(TinyLMConfig.preset(preset, seed=seed))
        summary = _train(task, model, tokenizer, preset, seed, settings)
    log.info(
        "warm-start %s seed %d: %s after %d steps, %.1f s; sampled %.3f greedy %.3f mixed groups %s",
        task,
        seed,
        summary.stopped,
        summary.steps,
        summary.seconds,
        summary.sampled_accuracy,
        summary.greedy_accuracy,
        summary.mixed_groups,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=parent))
    try:
        save_pretrained_dir(model, tokenizer, tmp)
        (tmp / SUMMARY).write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
        tmp.rename(final)
    except OSError:
        if not (final / SUMMARY).is_file():
            raise
        log.info("warm-start %s seed %d: another process finished %s first; using it", task, seed, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def load_summary(path: str | os.PathLike[str]) -> WarmStartSummary:
    """The ``warmstart.json`` of a warm-start folder."""
    return msgspec.json.decode((Path(path) / SUMMARY).read_bytes(), type=WarmStartSummary)
