"""Data shapes of the Engine protocol: token ids in, token ids (with logprobs and versions) out."""

from __future__ import annotations

from typing import Literal

import msgspec

from ..config.train import DEFAULT_MAX_NEW_TOKENS

FinishReason = Literal["stop", "length", "abort"]
Alternatives = list[tuple[int, float]]
"""The most likely tokens at one position, most likely first: (token id, logprob)."""
PauseMode = Literal["abort", "wait", "keep"]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How to sample one request (vLLM's names and meanings)."""

    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    """Stop after this many new tokens (finish reason "length"); the default is
    ``train.max_new_tokens``'s."""
    stop_token_ids: list[int] = []
    """Tokens that end the response (kept in the output, finish reason "stop")."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence token."""
    seed: int | None = None
    """Seed of this request's own random generator (reproducible sampling)."""
    top_logprobs: int = 0
    """Also return, at each position, this many most likely tokens with their logprobs (the
    OpenAI API's ``top_logprobs``), under the distribution the sampled token's logprob is under;
    0: none. The torch engine and vLLM return them; SGLang refuses a request that asks."""
    grammar: str = ""
    """A Lark grammar (llguidance's dialect) the sampled tokens must follow: structured outputs
    (``rlasync.engines.grammar``); "" for none."""


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """New tokens of a streaming request; the last chunk has a finish reason."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the temperature-scaled distribution
    versions: list[int]  # weight version that produced each token
    finish_reason: FinishReason | None = None
    top_logprobs: list[Alternatives] = []  # per token, when SamplingParams.top_logprobs asks


class GenerateOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request: everything it generated (partial when aborted)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    engine: str = ""  # name of the engine actor that served it (set by EngineActor)
    top_logprobs: list[Alternatives] = []  # per token, when SamplingParams.top_logprobs asks


class RequestProgress:
    """What an engine has produced for one request so far; every engine keeps one per request."""

    __slots__ = ("request", "tokens", "logprobs", "versions", "finish", "top_logprobs")

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: FinishReason | None = None
        self.top_logprobs: list[Alternatives] = []  # only when the request asks for them

    def output(self) -> GenerateOutput:
        """The request's result (partial when it was aborted); only once it has finished."""
        assert self.finish is not None
        r = self.request
        return GenerateOutput(
            request_id=r.request_id,
            prompt_ids=list(r.prompt_ids),
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish,
            top_logprobs=list(self.top_logprobs),
        )


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    running: int
    waiting: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    kv_cache_bytes: int
    weight_version: int
    paused: bool
    finished: int = 0  # requests finished (any reason) since the engine started
    generated_tokens: int = 0  # tokens generated since the engine started
    batch_size: int = 0  # sequences in the last decode step (0: the engine does not say)
    sleeping: bool = False  # between ``sleep`` and ``wake_up`` (``cluster.colocate``)
    oldest_running_version: int = -1
    """The oldest weight version among the tokens of the requests being decoded (a request
    carried across a swap with ``interrupt=keep`` holds tokens of its older version); -1: none
    running, or the engine does not say."""
