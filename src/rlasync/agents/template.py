"""Token ids of a conversation's turns, taken from the model's own chat template.

The loop never re-tokenises what the model generated: the model's tokens go into the
trajectory as they came. What the environment adds after a model turn (the template's turn
separator, the tool or user message, the next assistant header) is the *difference* between
two renderings of the template, so the training sequence is exactly what the model saw,
separators included (verl's dropped ``\\n`` after ``<|im_end|>`` cannot happen here).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import msgspec

PROMPT_CACHE_SIZE = 4096
# Rendered prompts per tokenizer: every trajectory of a GRPO group starts from the same prompt,
# and rendering the chat template is the costliest step of starting one (measured: 65 ms of
# the controller's 175 ms per quickstart step before this cache).
_prompt_cache: weakref.WeakKeyDictionary[Any, collections.OrderedDict[bytes, tuple[int, ...]]] = weakref.WeakKeyDictionary()


class TemplateError(ValueError):
    """The chat template does not render turns as a pure extension of the conversation so far."""


class ChatTurns:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        end = tokenizer.eos_token
        if not end:
            raise TemplateError("the tokenizer has no eos token: cannot tell where a model turn ends")
        self.turn_end = str(end)
        self._base: list[dict[str, Any]] = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        self._before = ""  # the base conversation rendered, computed on first use

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, generation_prompt: bool) -> str:
        text: str = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt: the conversation so far and the assistant header the model continues
        (remembered per tokenizer for the last ``PROMPT_CACHE_SIZE`` prompts)."""
        try:
            key = msgspec.json.encode([messages, tools])
            cache = _prompt_cache.setdefault(self.tokenizer, collections.OrderedDict())
        except (TypeError, msgspec.EncodeError):  # contents that are not plain data, or a tokenizer without weak references
            return self.encode(self.render(messages, tools=tools, generation_prompt=True))
        ids = cache.get(key)
        if ids is None:
            ids = tuple(self.encode(self.render(messages, tools=tools, generation_prompt=True)))
            cache[key] = ids
            if len(cache) > PROMPT_CACHE_SIZE:
                cache.popitem(last=False)
        return list(ids)

    def after_model_turn(self, messages: list[dict[str, Any]]) -> list[int]:
        """What the template puts after a model turn that ended with its end token, then
        ``messages`` (tool or user turns), then the next assistant header.

        Message contents are tokenised as plain text: a tool that prints ``<|im_end|>`` must
        not end a turn the model did not end (the template's own markup keeps its special
        tokens). Each content is swapped for a placeholder while rendering, then encoded on
        its own with special tokens split.
        """
        if not self._before:
            self._before = self.render(self._base, generation_prompt=False)
        before = self._before
        marked = [dict(m, content=f"\x00{i}\x00") if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)]
        after = self.render(self._base + marked, generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError("the chat template re-renders earlier turns when a turn is added; token-exact turns need a template that only appends")
        end = before.rfind(self.turn_end)
        if end < 0:
            raise TemplateError(f"the chat template does not end an assistant turn with the eos token {self.turn_end!r}")
        text = before[end + len(self.turn_end) :] + after[len(before) :]
        pieces = text.split("\x00")
        if len(pieces) != 2 * sum(1 for m in marked if m is not None and isinstance(m.get("content"), str)) + 1:
            # The template changed the placeholders (it transforms contents): render plainly.
            plain = self.render(self._base + list(messages), generation_prompt=True)
            return self.encode(before[end + len(self.turn_end) :] + plain[len(before) :])
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.encode(piece)
            else:
                content = messages[int(piece)]["content"]
                ids += self.tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        return ids
