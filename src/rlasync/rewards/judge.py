"""An LLM judge as a reward: any OpenAI-compatible endpoint (``rlasync serve`` of a judge model
included) reads a rubric prompt about the trajectory and answers with a verdict.

    data:
      reward:
        llm_judge:
          url: http://judge-host:8000/v1
          prompt: "Question: {question}\\nReference: {ground_truth}\\nAnswer: {response}\\n..."
          verdict: score          # "Score: 7" out of max_score (10), or yes_no
          timeout_s: 20           # the whole judgement, retries included
          retries: 2

The prompt is ``str.format``-ed with ``question`` (the last user message before the answer),
``response`` (the final answer), ``ground_truth`` and ``conversation`` (every turn, as text).
The verdict is parsed from the judge's reply: ``score`` takes the last number after ``Score:``
(or a reply that is only a number) over ``max_score``, ``yes_no`` 1.0 for a reply starting with yes and
0.0 for no. A reply that is neither, an endpoint that fails after ``retries``, or a judgement
past ``timeout_s`` raises, which the reward's caller records as a 0.0 with the error (counted in
``reward/errors``): a step never waits on a judge longer than its timeout. Calls run at once up
to ``max_concurrency`` per process; the same prompt is judged once (``cache_size`` verdicts kept).
Needs ``pip install 'rlasync[openai]'``.
"""

from __future__ import annotations

import asyncio
import collections
import re
from typing import Any, Literal

from .registry import RewardInput, RewardOutput

DEFAULT_PROMPT = (
    "You are grading an answer.\n"
    "Question: {question}\n"
    "Reference answer: {ground_truth}\n"
    "Answer to grade: {response}\n"
    "How correct is the answer, from 0 (wrong) to 10 (fully correct)? Reply with 'Score: <number>'."
)

_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(RuntimeError):
    """The judge's reply held no verdict, or the judge could not be reached."""


class LLMJudge:
    """The ``llm_judge`` reward (see the module docstring); a ``RewardInput`` in, a ``RewardOutput`` out."""

    def __init__(
        self,
        *,
        url: str,
        model: str = "",
        prompt: str = DEFAULT_PROMPT,
        verdict: Literal["score", "yes_no"] = "score",
        max_score: float = 10.0,
        timeout_s: float = 30.0,
        retries: int = 2,
        max_concurrency: int = 16,
        cache_size: int = 4096,
        api_key: str = "-",
        max_tokens: int = 32,
        temperature: float = 0.0,
    ) -> None:
        if verdict not in ("score", "yes_no"):
            raise ValueError(f"llm_judge.verdict: score or yes_no, got {verdict!r}")
        if timeout_s <= 0 or retries < 0 or max_concurrency < 1 or max_score <= 0:
            raise ValueError(
                "llm_judge: timeout_s and max_score must be > 0, retries >= 0, max_concurrency >= 1"
            )
        try:
            prompt.format(question="", response="", ground_truth="", conversation="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"llm_judge.prompt: {exc!r}: it may name only {{question}}, {{response}}, {{ground_truth}}, "
                "{conversation} (write other braces doubled)"
            ) from None
        self.url, self.model, self.prompt, self.verdict = url.rstrip("/"), model, prompt, verdict
        self.max_score, self.timeout_s, self.retries = max_score, timeout_s, retries
        self.api_key, self.max_tokens, self.temperature = api_key, max_tokens, temperature
        self.max_concurrency, self.cache_size = max_concurrency, cache_size
        self.__name__ = self.__qualname__ = "llm_judge"  # what its failures are logged under
        self._cache: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._client: Any = None
        self._slots: asyncio.Semaphore | None = None
        self.calls = 0
        """Requests sent to the judge (cache hits send none)."""

    async def __call__(self, inp: RewardInput) -> RewardOutput:
        prompt = self.prompt.format(
            question=_question(inp.messages),
            response=inp.response_text,
            ground_truth=inp.ground_truth or "",
            conversation=inp.full_text,
        )
        if prompt in self._cache:
            self._cache.move_to_end(prompt)
            return RewardOutput(score=self._cache[prompt], metrics={"judge_cached": 1.0})
        async with asyncio.timeout(
            self.timeout_s
        ):  # the whole judgement, waiting for a slot and retries included
            reply = await self._ask(prompt)
        score = self.parse(reply)
        self._cache[prompt] = score
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return RewardOutput(score=score, metrics={"judge_cached": 0.0})

    def parse(self, reply: str) -> float:
        """The verdict of a reply, in [0, 1]; ``JudgeError`` if it holds none."""
        if self.verdict == "yes_no":
            head = reply.strip().lower().lstrip("*[('\"")
            if head.startswith("yes"):
                return 1.0
            if head.startswith("no"):
                return 0.0
            raise JudgeError(f"the judge's reply is neither yes nor no: {reply[:200]!r}")
        found = _SCORE.findall(reply) or ([reply.strip()] if _NUMBER.fullmatch(reply.strip()) else [])
        if not found:
            raise JudgeError(f"the judge's reply holds no 'Score: <number>': {reply[:200]!r}")
        return min(max(float(found[-1]) / self.max_score, 0.0), 1.0)

    async def _ask(self, prompt: str) -> str:
        import openai

        if self._client is None:
            self._client = openai.AsyncOpenAI(base_url=self.url, api_key=self.api_key, max_retries=0)
            self._slots = asyncio.Semaphore(self.max_concurrency)
        assert self._slots is not None
        async with self._slots:
            if not self.model:  # the endpoint's only (or first) model
                models = await self._client.models.list()
                self.model = models.data[0].id
            for attempt in range(self.retries + 1):
                try:
                    self.calls += 1
                    reply = await self._client.chat.completions.create(
                        model=self.model,
                        messages=[{"role": "user", "content": prompt}],
                        max_tokens=self.max_tokens,
                        temperature=self.temperature,
                    )
                    return str(reply.choices[0].message.content or "")
                except (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError) as exc:
                    if attempt == self.retries:
                        raise JudgeError(
                            f"the judge at {self.url} failed {attempt + 1} times: {exc}"
                        ) from None
                    await asyncio.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


def _question(messages: list[dict[str, Any]]) -> str:
    """The last user message before the final answer (the question the answer answers)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return ""
