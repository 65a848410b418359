"""A byte-level BPE tokenizer trained in code, for tiny models on machines with no model hub.

It uses Qwen2's own pre-tokenizer pipeline (NFC, Qwen's split regex, byte level), so that
``AutoTokenizer`` — which maps ``model_type=qwen2`` to ``Qwen2Tokenizer`` and rebuilds that
pipeline on load — reloads it faithfully (a custom pre-tokenizer would be silently
replaced). Digits are always one token each (the regex splits ``\\p{N}`` singly), and merges
are learned only from the chat template's and JSON's words: merges learned on task payloads
glue letters together (``abcd`` → ``a|bc|d``), which measurably capped reversal accuracy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

if TYPE_CHECKING:  # transformers (0.4 s to import) loads when a tokenizer is built, not with the models
    from transformers import PreTrainedTokenizerFast

from .chat_template import CHAT_TEMPLATE

# transformers' Qwen2Tokenizer uses exactly this pattern; keep them equal (a test checks).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
SPECIAL_TOKENS = (PAD, IM_START, IM_END, *TOOL_TOKENS)

# What the merges are learned from: the words of the template and of tool-call JSON.
TEMPLATE_WORDS = (
    "system",
    "user",
    "assistant",
    "tool",
    "tools",
    "<tools>",
    "</tools>",
    '{"name": "',
    '", "arguments": ',
    '{"expression": "',
    '"}',
    "}",
    '{"type": "function", "function": ',
    '"description": "',
    '"parameters": ',
    '"properties": ',
    '"required": [',
    '"type": "object"',
    '"type": "string"',
    "name",
    "arguments",
    "expression",
    "description",
    "parameters",
    "properties",
    "required",
    "type",
    "object",
    "string",
    "function",
    "calc",
    "calculator",
    "python",
    "Reverse",
    "What is",
    "Answer",
    "Compute",
    "the",
    "is",
)


def _corpus(extra_words: Iterable[str]) -> list[str]:
    words = list(TEMPLATE_WORDS) + list(extra_words)
    return [" ".join(words)] * 50 + words * 20


def build_tokenizer(vocab_size: int = 384, extra_words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """Train the tokenizer: 256 byte tokens, the special tokens, merges up to ``vocab_size``."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(extra_words), trainer=trainer)
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=PAD,
        additional_special_tokens=list(TOOL_TOKENS) + [IM_START],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
