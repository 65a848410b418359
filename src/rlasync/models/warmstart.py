"""Supervised warm-start on a synthetic task, so RL starts from a policy that emits the
format but is often wrong; cached under the run directory.

    path = warm_start("calc", run_dir="runs/quick", seed=0)   # ~1 min on 2 cores, then cached
    model, tokenizer = load_pretrained_dir(path)

It builds a tiny model (``build_tiny_lm``) and trains it on correct solutions (loss only on
the tokens the model itself generates: not the prompt, not tool responses). Every
``check_every`` steps it measures accuracy on fixed validation problems with the torch
engine and the same multi-turn episode RL runs, sampled (temperature 1) and greedy, and
stops once either reaches its threshold. A fixed step count is fragile: these tasks learn
through a sharp phase transition whose timing depends on the data order (feasibility notes
§2), and accuracy can go from 0 to 0.6 between two checks, so the check that crosses a
threshold sends training back to the check before, to replay the same batches checking
every ``refine_every`` steps. The folder,
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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..data.synthetic import (
    Problem,
    get_task,
    iter_problems,
    make_problems,
    parse_tool_call,
    run_tool,
)
from .tiny import TinyLMConfig, build_tiny_lm, save_pretrained_dir
from .tokenizer import IM_END

log = logging.getLogger(__name__)

VERSION = 1
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


DEFAULT_SETTINGS: dict[str, WarmStartSettings] = {
    "reverse": WarmStartSettings(),
    # At lr 3e-3 two of three seeds stalled at loss ~0.9 (one hit 600 steps at 0.06).
    "arith": WarmStartSettings(lr=1e-3),
    # Sequences are ~5x longer (tool schema, call, response): half the batch.
    "calc": WarmStartSettings(batch_size=32, max_steps=300),
}
"""Measured on 2 cores (one thread, seeds 0–2): reverse stops in 10–14 s, arith in 12–21 s, calc
in 46–51 s, with sampled accuracy 0.12–0.27, greedy 0.25–0.67 (calc's greedy runs ahead: one
wrong token in its 25-token tool call fails a sample) and 44–75 % of validation problems
giving a GRPO group of 8 both rewards (``mixed_groups``)."""


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
def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: Any, problem: Problem) -> list[int]:
    return _encode(tokenizer, _render(tokenizer, problem.messages, problem.tools, True))


def encode_sft(tokenizer: Any, problem: Problem) -> tuple[list[int], list[int]]:
    """The token ids of prompt + solution, and a mask (1) of the tokens the model generates.

    The conversation is rendered turn by turn and each rendering must extend the previous
    one token for token, so the solution's ids are exactly what the model would produce
    after the prompt the engine sees. An assistant turn is the model's up to and including
    ``<|im_end|>`` (where generation stops); the template's newline after it, tool
    responses and the next turn's header are the environment's (mask 0).
    """
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    conversation = list(problem.messages)
    ids = prompt_ids(tokenizer, problem)
    mask = [0] * len(ids)
    for i, message in enumerate(problem.target):
        conversation.append(message)
        next_is_assistant = i + 1 < len(problem.target) and problem.target[i + 1]["role"] == "assistant"
        full = _encode(tokenizer, _render(tokenizer, conversation, problem.tools, next_is_assistant))
        if full[: len(ids)] != ids:
            raise ValueError(
                f"{problem.task} {problem.key!r}: the chat template's rendering of turn {i} is not an extension of the previous turns"
            )
        new = full[len(ids) :]
        owned = new.index(im_end) + 1 if message["role"] == "assistant" else 0
        mask += [1] * owned + [0] * (len(new) - owned)
        ids = full
    return ids, mask


def tool_turn_ids(tokenizer: Any, problem: Problem, result: str) -> list[int]:
    """What the environment appends after an assistant turn that called a tool: the rest of
    that turn, the tool's response, the next assistant header (as the chat template renders it)."""
    conversation = [*problem.messages, {"role": "assistant", "content": "x"}]
    before = _render(tokenizer, conversation, problem.tools, False)
    after = _render(tokenizer, [*conversation, {"role": "tool", "content": result}], problem.tools, True)
    assert after.startswith(before)
    return _encode(tokenizer, before[before.rindex(IM_END) + len(IM_END) :] + after[len(before) :])


# -- episodes -------------------------------------------------------------------------------
class Episode(msgspec.Struct, kw_only=True):
    """One rollout of a problem: token in, token out, never re-tokenised."""

    prompt_ids: list[int]
    completion_ids: list[int]  # every token after the prompt: generated and environment
    completion_mask: list[int]  # 1 = generated by the model
    logprobs: list[float]  # of generated tokens; 0.0 for environment tokens
    final: str  # the last assistant turn's text, the answer the reward reads
    tool_calls: int
    reward: float


async def run_episode(
    engine: Any,
    tokenizer: Any,
    problem: Problem,
    *,
    temperature: float,
    seed: int,
    request_id: str,
    max_turns: int = 3,
) -> Episode:
    """Sample assistant turns; while a turn calls a tool (and turns remain), run it and go on."""
    from ..engines import GenerateRequest, SamplingParams

    task = get_task(problem.task)
    prompt = prompt_ids(tokenizer, problem)
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    calls = 0
    final = ""
    for turn in range(max_turns):
        params = SamplingParams(
            temperature=temperature, max_new_tokens=task.max_new_tokens, seed=_mix(seed, turn)
        )
        out = await engine.generate(
            GenerateRequest(request_id=f"{request_id}.{turn}", prompt_ids=prompt + ids, params=params)
        )
        ids += out.token_ids
        mask += [1] * len(out.token_ids)
        logprobs += out.logprobs
        final = tokenizer.decode(out.token_ids, skip_special_tokens=False).removesuffix(IM_END)
        call = parse_tool_call(final)
        if call is None or out.finish_reason != "stop" or turn + 1 == max_turns:
            break
        calls += 1
        env = tool_turn_ids(tokenizer, problem, run_tool(*call))
        ids += env
        mask += [0] * len(env)
        logprobs += [0.0] * len(env)
    reward = 0.0 if parse_tool_call(final) is not None else task.reward(problem, final)
    return Episode(
        prompt_ids=prompt,
        completion_ids=ids,
        completion_mask=mask,
        logprobs=logprobs,
        final=final,
        tool_calls=calls,
        reward=reward,
    )


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def _mix(*values: int) -> int:
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


async def _rollouts(
    model: Any, tokenizer: Any, problems: list[Problem], *, temperature: float, seed: int, samples: int
) -> list[list[Episode]]:
    from ..engines import TorchEngine

    engine = TorchEngine(model, max_batch=128, seed=seed)
    try:
        flat = await asyncio.gather(
            *[
                run_episode(
                    engine,
                    tokenizer,
                    p,
                    temperature=temperature,
                    seed=_mix(seed, i, j),
                    request_id=f"{i}.{j}",
                )
                for i, p in enumerate(problems)
                for j in range(samples)
            ]
        )
    finally:
        await engine.close()
    return [flat[i * samples : (i + 1) * samples] for i in range(len(problems))]


def evaluate(
    model: Any, tokenizer: Any, problems: list[Problem], *, temperature: float, seed: int, samples: int = 1
) -> list[list[Episode]]:
    """``samples`` episodes per problem with a fresh torch engine (runs its own event loop)."""
    was_training = model.training
    try:
        return asyncio.run(
            _rollouts(model, tokenizer, problems, temperature=temperature, seed=seed, samples=samples)
        )
    finally:
        model.train(was_training)


# -- training -------------------------------------------------------------------------------
def _batches(tokenizer: Any, task: str, seed: int, batch_size: int) -> Iterator[tuple[Any, Any]]:
    """Right-padded batches (positions 0.. as in generation): input ids and labels (-100 = no loss)."""
    import torch

    pad = tokenizer.pad_token_id
    cache: dict[str, tuple[list[int], list[int]]] = {}
    problems = iter_problems(task, seed=seed, split="train")
    while True:
        rows = []
        for _ in range(batch_size):
            p = next(problems)
            if p.key not in cache:
                cache[p.key] = encode_sft(tokenizer, p)
            rows.append(cache[p.key])
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for r, (x, m) in enumerate(rows):
            ids[r, : len(x)] = torch.tensor(x)
            labels[r, : len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(x), -100)
        yield ids, labels


def _train(
    task: str, model: Any, tokenizer: Any, preset: str, seed: int, settings: WarmStartSettings
) -> WarmStartSummary:
    """SFT until a check meets a threshold. When one does, go back to the previous check's
    state and replay the same batches checking every ``refine_every`` steps, to stop near the
    first step that meets it: the accuracy can jump from 0 to 0.6 between two checks."""
    import torch
    import torch.nn.functional as F

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
        ids, labels = batch = next(batches)
        since_saved.append(batch)
        # Right padding: real tokens never attend to the padding after them, so no attention
        # mask is needed, and positions count from 0 exactly as when the engine generates.
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % every and step < settings.max_steps:
            continue
        sampled = [e[0] for e in evaluate(model, tokenizer, problems, temperature=1.0, seed=_mix(seed, 1))]
        greedy = [e[0] for e in evaluate(model, tokenizer, problems, temperature=0.0, seed=0)]
        check = Check(
            step=step,
            loss=_mean(losses),
            sampled_accuracy=_mean(e.reward for e in sampled),
            greedy_accuracy=_mean(e.reward for e in greedy),
        )
        history.append(check)
        losses.clear()
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
            model, tokenizer, problems, temperature=1.0, seed=_mix(seed, 2), samples=settings.group_size
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
        tool_use=_mean(e.tool_calls > 0 for e in greedy),
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
