"""The tiny-model kit: sizes, tokenizer properties, chat template with tools, offline round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlasync.models import (
    SPECIAL_TOKENS,
    TinyLMConfig,
    build_tiny_lm,
    build_tokenizer,
    load_pretrained_dir,
    save_pretrained_dir,
)
from rlasync.models.tokenizer import QWEN2_SPLIT

PROBES = [
    "Reverse abcd",
    "What is 37*58?",
    "héllo wörld 日本語 🙂 12345",
    '<tool_call>{"name": "calc", "arguments": {}}</tool_call><|im_end|>',
    "a\n\n  b\tc",
]


@pytest.fixture(scope="module")
def nano() -> tuple[object, object]:
    return build_tiny_lm(TinyLMConfig.preset("nano"))


@pytest.mark.parametrize(
    ("preset", "low", "high"), [("nano", 0.6e6, 0.9e6), ("micro", 3e6, 5e6), ("mini", 15e6, 25e6)]
)
def test_presets_have_the_documented_sizes(preset: str, low: float, high: float) -> None:
    model, _ = build_tiny_lm(TinyLMConfig.preset(preset))
    assert low < sum(p.numel() for p in model.parameters()) < high


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    b, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    c, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=4))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_bad_shape_names_the_fields() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyLMConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="preset"):
        TinyLMConfig.preset("huge")


def test_tokenizer_round_trips_text_and_splits_digits() -> None:
    tok = build_tokenizer()
    assert len(tok) == 384
    for text in PROBES:
        assert tok.decode(tok.encode(text)) == text
    digits = tok.convert_ids_to_tokens(tok.encode("12345"))
    assert digits == ["1", "2", "3", "4", "5"]
    letters = tok.convert_ids_to_tokens(tok.encode("abcd"))
    assert letters == ["a", "b", "c", "d"]  # no merges learned inside task payloads
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special)) == 1, special


def test_split_pattern_is_transformers_qwen2_pattern() -> None:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_SPLIT == PRETOKENIZE_REGEX  # else AutoTokenizer would reload a different tokenizer


def test_chat_template_renders_tools_calls_and_responses() -> None:
    tok = build_tokenizer()
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "What is 37*58?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calc", "arguments": {"expression": "37*58"}}}],
        },
        {"role": "tool", "content": "2146"},
        {"role": "assistant", "content": "2146"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == (
        '<|im_start|>system\n<tools>{"name": "calc", "parameters": {"type": "object"}}</tools><|im_end|>\n'
        "<|im_start|>user\nWhat is 37*58?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"expression": "37*58"}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>2146</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n2146<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 37*58?<|im_end|>\n<|im_start|>assistant\n"


def test_save_and_reload_offline_with_auto_classes(nano, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    save_pretrained_dir(model, tok, tmp_path / "nano")
    model2, tok2 = load_pretrained_dir(tmp_path / "nano")
    for text in PROBES:
        assert tok2.encode(text) == tok.encode(text), text
    assert tok2.chat_template == tok.chat_template
    assert tok2.eos_token == "<|im_end|>" and tok2.pad_token == "<|endoftext|>"
    ids = torch.tensor([tok.encode("Reverse abcd")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    assert model2.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_loading_a_folder_that_is_not_a_model_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="build_tiny_lm"):
        load_pretrained_dir(tmp_path)
