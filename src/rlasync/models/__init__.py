"""Tiny models and tokenizers built in code (no model hub), and offline loading of HF folders."""

from .chat_template import CHAT_TEMPLATE
from .tiny import TinyLMConfig, build_tiny_lm, load_pretrained_dir, save_pretrained_dir
from .tokenizer import SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE", "SPECIAL_TOKENS", "TinyLMConfig", "build_tiny_lm", "build_tokenizer",
    "load_pretrained_dir", "save_pretrained_dir",
]  # fmt: skip
