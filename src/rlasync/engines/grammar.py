"""Constrained sampling in the torch engine: a request whose ``SamplingParams.grammar`` is set
samples only tokens the grammar allows (structured outputs: JSON, a JSON schema, a forced tool
call). The grammar is a Lark grammar in llguidance's dialect (``%json {schema}`` embeds a JSON
schema; ``<[id]>`` is a token by id), so the serving layer writes one grammar for every engine
(vLLM's ``guidance`` backend reads the same).

Each request gets its own matcher at submission; the worker masks the disallowed tokens of the
constrained rows before sampling (their logits -inf), so a token's logprob is under the
distribution it was actually drawn from, and feeds the matcher each sampled token. When the
grammar is complete only the end-of-sequence token remains allowed: the turn ends as any turn
does (a chat call continued later goes on from that token). A request that is resumed from its partial output (a longer prompt) starts its
grammar again: constrained turns should not be cut (``async_training.interrupt: keep``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch

from .protocol import EngineError

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)
"""Bit i of each 32-bit word of a token bitmask: token 32 * word + i allowed."""


class Grammars:
    """The grammar machinery of one engine: its tokenizer as llguidance sees it (made at the
    first constrained request), a matcher per constrained request, the masking of a batch."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int | None) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos
        self._lltokenizer: Any = None
        self._lock = threading.Lock()  # one thread builds the llguidance tokenizer

    async def compile(self, grammar: str) -> Any:
        """``matcher(grammar)`` off the event loop: the first one reads the whole vocabulary
        (a second or more for a 150k-token one), and a large schema takes a while to compile."""
        return await asyncio.to_thread(self.matcher, grammar)

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of ``grammar`` (an ``EngineError`` saying why if it is not one)."""
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise EngineError("constrained decoding needs llguidance: pip install llguidance") from None
        if self.tokenizer is None:
            raise EngineError("this engine was built without its tokenizer, which constrained decoding needs")
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar)
        if matcher.is_error():
            raise EngineError(f"the request's grammar is not one: {matcher.get_error()}")
        return matcher

    def mask(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """(worker) Set to -inf the logits of the tokens each row's matcher disallows (a row whose
        matcher is None is not constrained)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        # Filled and applied here rather than with llguidance.torch, whose module compiles
        # TorchScript when imported (the first constrained request stalled ~10 s).
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for j, i in enumerate(rows):
            if matchers[i].is_stopped():  # the grammar is done: the turn ends as any turn does
                bitmask[j] = 0
                if self.eos is not None:
                    bitmask[j, self.eos // 32] = 1 << (self.eos % 32)
            else:
                matchers[i].unsafe_compute_mask_ptr(bitmask[j].data_ptr(), bitmask.shape[1] * 4)
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, : logits.shape[-1]]
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        """(worker) Feed the matcher the sampled token; False when the request must end (the
        grammar was done, or refuses the token)."""
        if matcher.is_stopped():  # done before this token (which was forced to end-of-sequence)
            return False
        if matcher.consume_token(token):
            return True  # done now or not: once done, the next token is forced to end the turn
        log.warning(
            "a constrained request's token %d was refused by its grammar: %s", token, matcher.get_error()
        )
        return False
