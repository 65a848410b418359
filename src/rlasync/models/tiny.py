"""Tiny Qwen2-architecture causal LMs built from a config, saved and loaded offline.

    model, tokenizer = build_tiny_lm(TinyLMConfig.preset("nano"))
    save_pretrained_dir(model, tokenizer, "runs/nano")
    model, tokenizer = load_pretrained_dir("runs/nano")     # any HF causal-LM folder works

Sizes, as measured on 2 cores: "nano" (0.8 M parameters) learns string reversal and
calculator tool use in minutes; "micro" (~4 M) and "mini" (~20 M) are for engine and
throughput work. Nano has three layers: with two, some seeds' models could not learn to
reverse six letters at all (after 1,000 supervised steps, 15 of 37 held-out six-letter words
still wrong at seed 0; with three, 2 of 37 after 400), and RL then stalled at 0.75.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from .tokenizer import IM_END, build_tokenizer


class TinyLMConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape of a tiny Qwen2 model (``model.*`` in a YAML config)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (query)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 512
    """Width of the MLP."""
    vocab_size: int = 384
    """Tokenizer size: 256 bytes + 7 special tokens + learned merges."""
    max_position_embeddings: int = 1024
    """Longest sequence (prompt + response) the model is built for."""
    seed: int = 0
    """Seed of the random initial weights."""

    PRESETS: ClassVar[dict[str, dict[str, int]]] = {
        "nano": {
            "hidden_size": 128,
            "num_layers": 3,  # two could not hold six-letter reversal at every seed (see above)
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 512,
        },
        "micro": {
            "hidden_size": 256,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 1024,
        },
        "mini": {
            "hidden_size": 512,
            "num_layers": 6,
            "num_heads": 8,
            "num_kv_heads": 4,
            "intermediate_size": 1536,
        },
    }

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TinyLMConfig:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown tiny-model preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError(
                f"model: num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads}), "
                f"and num_heads must divide hidden_size ({self.hidden_size})"
            )


def build_tiny_lm(config: TinyLMConfig | str = "nano") -> tuple[Any, Any]:
    """A freshly initialised ``Qwen2ForCausalLM`` and its trained-in-code tokenizer, from a
    ``TinyLMConfig`` or a preset's name (``"nano"``, ``"micro"``, ``"mini"``)."""
    import torch

    if isinstance(config, str):
        config = TinyLMConfig.preset(config)
    keep_temporary_folder_clean()
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(config.vocab_size)
    hf_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,  # PAD, as build_tokenizer sets it
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(hf_config)
    model.generation_config = GenerationConfig(
        eos_token_id=hf_config.eos_token_id, pad_token_id=hf_config.pad_token_id, bos_token_id=None
    )
    model.eval()
    return model, tokenizer


def save_pretrained_dir(model: Any, tokenizer: Any, path: str | os.PathLike[str]) -> Path:
    """Write a Hugging Face folder (safetensors, config, tokenizer, chat template)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def keep_temporary_folder_clean() -> None:
    """transformers' model code imports ``torch._dynamo``, which makes a cache folder in the
    temporary directory (``$TMPDIR/torchinductor_<user>``) and leaves it there: unless the user
    chose one, torch's cache goes to ``~/.cache/rlasync/torchinductor`` (``XDG_CACHE_HOME``).
    Call before importing a transformers model; processes started afterwards inherit it."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlasync" / "torchinductor"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))


# transformers' loading patches torch globally (meta-device init), and its lazy module is not
# safe to import from two threads at once (a run reads its tokenizer while an engine loads: one
# of the two got an ImportError): imports and loads, one at a time per process.
_LOAD_LOCK = threading.Lock()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer (and chat template) of a Hugging Face folder, from disk only."""
    with _LOAD_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def load_pretrained_dir(
    path: str | os.PathLike[str], *, dtype: Any = None, device: str = "cpu"
) -> tuple[Any, Any]:
    """Load any Hugging Face causal-LM folder from disk only (never the hub)."""
    import torch

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} is not a model folder (no config.json); build one with rlasync.models.build_tiny_lm"
        )
    with _LOAD_LOCK:  # two engines on one node loading at once corrupted each other
        keep_temporary_folder_clean()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=dtype or torch.float32
        )
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper of `to` is typed for its own arguments
    model.eval()
    return model, tokenizer
