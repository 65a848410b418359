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
from collections.abc import Iterable
from typing import Any

import msgspec

PROMPT_CACHE_SIZE = 4096
# Rendered prompts per tokenizer: every trajectory of a GRPO group starts from the same prompt,
# and rendering the chat template is the costliest step of starting one (measured: 65 ms of
# the controller's 175 ms per quickstart step before this cache).
_prompt_cache: weakref.WeakKeyDictionary[Any, collections.OrderedDict[bytes, tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


class TemplateError(ValueError):
    """The chat template does not render turns as a pure extension of the conversation so far."""


class ChatTurns:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        end = tokenizer.eos_token
        if not end:
            raise TemplateError("the tokenizer has no eos token: cannot tell where a model turn ends")
        self.turn_end = str(end)
        self._base: list[dict[str, Any]] = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        self._before = ""  # the base conversation rendered, computed on first use

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        generation_prompt: bool,
    ) -> str:
        text: str = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt: the conversation so far and the assistant header the model continues
        (remembered per tokenizer for the last ``PROMPT_CACHE_SIZE`` prompts)."""
        try:
            key = msgspec.json.encode([messages, tools])
            cache = _prompt_cache.setdefault(self.tokenizer, collections.OrderedDict())
        except (
            TypeError,
            msgspec.EncodeError,
        ):  # contents that are not plain data, or a tokenizer without weak references
            return self.encode(self.render(messages, tools=tools, generation_prompt=True))
        ids = cache.get(key)
        if ids is None:
            ids = tuple(self.encode(self.render(messages, tools=tools, generation_prompt=True)))
            cache[key] = ids
            if len(cache) > PROMPT_CACHE_SIZE:
                cache.popitem(last=False)
        return list(ids)

    def encode_text(self, text: str) -> list[int]:
        """``text`` that came from outside the model (a tool, a user, an error about a model's
        call): special-token strings in it are plain text, never control tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_pieces(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Markup and environment text in order: ``(text, True)`` is environment text
        (``encode_text``), ``(text, False)`` markup, whose special tokens stay special."""
        ids: list[int] = []
        for text, environment in pieces:
            if text:
                ids += self.encode_text(text) if environment else self.encode(text)
        return ids

    def special_ids(self) -> set[int]:
        """Ids of the tokenizer's special tokens (control tokens: turn ends, headers, tool tags)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return set(self.tokenizer.all_special_ids) | {
            i for i, token in added.items() if getattr(token, "special", False)
        }

    def model_turn(
        self,
        conversation: list[dict[str, Any]],
        message: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids a model generates to say the assistant ``message`` after ``conversation``: the
        template's rendering of it, up to and including the turn end (what supervised
        fine-tuning trains a model to produce, ``rlasync.compose.warmstart``)."""
        before = self.render(conversation, tools=tools, generation_prompt=True)
        after = self.render([*conversation, message], tools=tools, generation_prompt=False)
        end = after.find(self.turn_end, len(before))
        if not after.startswith(before) or end < 0:
            raise TemplateError(
                "the chat template does not render an assistant turn as the prompt's continuation ending with "
                f"the eos token {self.turn_end!r}"
            )
        return self.encode(after[len(before) : end + len(self.turn_end)])

    def after_model_turn(self, messages: list[dict[str, Any]]) -> list[int]:
        """What the template puts after a model turn that ended with its end token, then
        ``messages`` (tool or user turns), then the next assistant header.

        Message contents and names are tokenised as plain text: a tool that prints
        ``<|im_end|>`` must not end a turn the model did not end, whatever its name (the
        template's own markup keeps its special tokens). Each is swapped for a placeholder while
        rendering, then encoded on its own with special tokens split. A template that changes
        the placeholders (it transforms what it renders) is rendered plainly, and refused
        (``TemplateError``) if that turns environment text into control tokens.
        """
        if not self._before:
            self._before = self.render(self._base, generation_prompt=False)
        before = self._before
        end = before.rfind(self.turn_end)
        if end < 0:
            raise TemplateError(
                f"the chat template does not end an assistant turn with the eos token {self.turn_end!r}"
            )
        values: dict[str, str] = {}
        marked = []
        for i, message in enumerate(messages):
            swapped = dict(message)
            for field in _ENVIRONMENT_FIELDS:
                if isinstance(message.get(field), str):
                    values[key := f"{i}.{field}"] = message[field]
                    swapped[field] = f"\x00{key}\x00"
            marked.append(swapped)
        after = self._after(before, marked)
        text = before[end + len(self.turn_end) :] + after[len(before) :]
        pieces = text.split("\x00")
        if len(pieces) % 2 == 1 and all(key in values for key in pieces[1::2]):
            return self.encode_pieces(
                (values[piece] if k % 2 else piece, bool(k % 2)) for k, piece in enumerate(pieces)
            )
        # The template changed the placeholders: render plainly, if no control token comes of it.
        ids = self.encode(before[end + len(self.turn_end) :] + self._after(before, messages)[len(before) :])
        neutral = [
            dict(m, **{f: "" for f in _ENVIRONMENT_FIELDS if isinstance(m.get(f), str)}) for m in messages
        ]
        expected = self.encode(
            before[end + len(self.turn_end) :] + self._after(before, neutral)[len(before) :]
        )
        specials = self.special_ids()
        if [i for i in ids if i in specials] != [i for i in expected if i in specials]:
            raise TemplateError(
                "a tool or user message holds special-token text, and this chat template transforms message "
                "contents, so they cannot be kept as plain text: use a template that renders contents as they are"
            )
        return ids

    def _after(self, before: str, messages: list[dict[str, Any]]) -> str:
        after = self.render(self._base + messages, generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template re-renders earlier turns when a turn is added; token-exact turns need a template that only appends"
            )
        return after


_ENVIRONMENT_FIELDS = ("content", "name")
"""Message fields whose text comes from outside the model (a template may render either)."""
