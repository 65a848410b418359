"""A reward model as a reward: a Hugging Face sequence-classification network scores each
trajectory's conversation, calls from many trajectories batched into one forward pass.

    data:
      reward:
        reward_model:
          path: models/my-rm          # a local folder (config.json, weights, tokenizer)
          batch_size: 16              # conversations scored in one pass, at most
          max_length: 2048            # tokens kept of each (the start is cut: the answer is last)
          score: sigmoid              # raw (the logit), sigmoid, or label:<i> (the softmax of label i)
          node: 1                     # optional: on this node only, for every agent-loop worker

It runs on each node that runs agent loops, in a thread off the event loop, loaded at its first
call (so a run that names one and never scores pays nothing); or, with ``node: N``, once, on
cluster node N (a node of its own, or the trainer's: ``rlasync.agents.reward_server``), where
every worker's calls go and share its batches. A conversation is rendered with the
reward model's chat template when its tokenizer has one, else as ``role: text`` lines. Calls that
arrive while a pass runs wait for the next one (``batch_size`` at most), so thousands of
concurrent trajectories make few passes. A failure is the caller's recorded 0.0, as for every
reward. Needs torch and transformers (rlasync's own dependencies).
"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

from .registry import RewardInput, RewardOutput, factory_options


def served_options(spec: str | dict[str, Any]) -> dict[str, Any] | None:
    """A reward setting's ``reward_model`` options (``name`` included) when it asks for a node of
    its own (``node`` set); else None."""
    options = factory_options(spec) if isinstance(spec, dict) else {}
    return options if options.get("name") == "reward_model" and options.get("node") is not None else None


class RewardModel:
    """The ``reward_model`` reward (see the module docstring)."""

    def __init__(
        self,
        *,
        path: str,
        batch_size: int = 16,
        max_length: int = 2048,
        score: str = "sigmoid",
        timeout_s: float = 120.0,
        node: int | None = None,
        served_by: Any = None,
    ) -> None:
        """``node``: the cluster node that runs it for the whole run (None: each agent-loop node
        its own); ``served_by``: that node's ``RewardModelServer``, which the run sets."""
        if node is not None and node < 0:
            raise ValueError(f"reward_model.node: a node rank (0 is the head), got {node}")
        if node is None and not (Path(path).expanduser() / "config.json").is_file():
            raise ValueError(f"reward_model.path={path!r} is not a model folder (no config.json)")
        if score not in ("raw", "sigmoid") and not (score.startswith("label:") and score[6:].isdigit()):
            raise ValueError(f"reward_model.score: raw, sigmoid or label:<index>, got {score!r}")
        if batch_size < 1 or max_length < 8:
            raise ValueError("reward_model: batch_size >= 1 and max_length >= 8")
        self.path, self.batch_size, self.max_length, self.score = (
            str(Path(path).expanduser()),
            batch_size,
            max_length,
            score,
        )
        self.timeout_s, self.node, self.served_by = timeout_s, node, served_by
        self.__name__ = self.__qualname__ = "reward_model"  # what its failures are logged under
        self._model: Any = None
        self._tokenizer: Any = None
        self._load_lock = threading.Lock()
        self._waiting: list[tuple[list[dict[str, Any]], asyncio.Future[float]]] = []
        self._running: asyncio.Task[None] | None = None
        self.passes = 0
        """Forward passes made (each scores up to ``batch_size`` conversations)."""

    async def __call__(self, inp: RewardInput) -> RewardOutput:
        messages = inp.messages or [{"role": "assistant", "content": inp.response_text}]
        if self.served_by is not None:  # on its own node: batched there with every worker's calls
            return RewardOutput(score=await self.served_by.score.options(timeout=self.timeout_s)(messages))
        if self.node is not None:  # never a second copy here: node N is where it was asked to be
            raise RuntimeError(
                f"reward_model.node={self.node} scores through its server on that node, which a run starts; "
                "in a script, spawn rlasync.agents.reward_server.RewardModelServer and pass served_by=its ref"
            )
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting.append((messages, future))
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._drain())
        return RewardOutput(score=await future)

    async def _drain(self) -> None:
        """Score what waits, a batch per pass, until nothing does (one drainer at a time)."""
        while self._waiting:
            batch, self._waiting = self._waiting[: self.batch_size], self._waiting[self.batch_size :]
            live = [(m, f) for m, f in batch if not f.done()]  # a caller past its deadline left
            if not live:
                continue
            try:
                scores = await asyncio.to_thread(self._scores, [m for m, _ in live])
            except Exception as exc:  # noqa: BLE001  (every caller of the pass gets it: a recorded 0.0 each)
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), score in zip(live, scores):
                if not future.done():
                    future.set_result(score)

    def _scores(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
        """(thread) One forward pass over ``conversations``."""
        import torch

        model, tokenizer = self.load()
        texts = [self._render(tokenizer, messages) for messages in conversations]
        batch = tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
        )
        with torch.inference_mode():
            logits = model(**batch).logits.float()
        self.passes += 1
        if self.score.startswith("label:"):
            return torch.softmax(logits, dim=-1)[:, int(self.score[6:])].tolist()
        first = logits[:, 0].tolist()
        return [1.0 / (1.0 + math.exp(-x)) for x in first] if self.score == "sigmoid" else first

    def load(self) -> tuple[Any, Any]:
        """(blocking) The model and tokenizer, loaded at the first call."""
        with self._load_lock:
            if self._model is None:
                from transformers import AutoModelForSequenceClassification, AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.path)
                tokenizer.truncation_side = "left"  # keep the end: the answer being judged
                if tokenizer.pad_token is None:
                    tokenizer.pad_token = tokenizer.eos_token
                model = AutoModelForSequenceClassification.from_pretrained(self.path).eval()
                if model.config.pad_token_id is None:
                    model.config.pad_token_id = tokenizer.pad_token_id
                self._model, self._tokenizer = model, tokenizer
            return self._model, self._tokenizer

    @staticmethod
    def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
        if getattr(tokenizer, "chat_template", None):
            return str(tokenizer.apply_chat_template(messages, tokenize=False))
        return "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in messages)
