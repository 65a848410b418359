"""What the backward keeps (``rlasync.trainer.activations``): the token logprobs' gradient written
into one tensor, and gated MLPs that recompute their activation, give autograd's own gradients
bit for bit (the same kernels on the same values, sums of two terms in either order) while
keeping less: exactly one MLP-wide tensor per layer and position fewer."""

from __future__ import annotations

import copy

import pytest
import torch

from rlasync.config import TrainerConfig
from rlasync.config.train import LoraSettings
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.trainer import PolicyTrainer, TrainBatch
from rlasync.trainer.activations import recompute_gated_activations, token_logprobs


@pytest.mark.numerics
def test_token_logprobs_give_autograds_values_and_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 301, generator=g) * 4).requires_grad_()
    tokens = torch.randint(0, 301, (3, 7), generator=g)
    upstream = torch.randn(3, 7, generator=g)
    ours = token_logprobs(logits, tokens)
    (ours_grad,) = torch.autograd.grad(ours, logits, upstream)
    theirs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    (theirs_grad,) = torch.autograd.grad(theirs, logits, upstream)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours_grad, theirs_grad)
    with torch.no_grad():  # no graph: the plain computation
        assert torch.equal(token_logprobs(logits, tokens), theirs)


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the tensors a forward keeps for its backward that it made (not the weights)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    return sum(kept.values())


@pytest.mark.numerics
def test_gated_mlps_recompute_their_activation_keep_one_tensor_less_and_give_the_same_gradients() -> None:
    model, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=1))
    lean = copy.deepcopy(model)
    config = model.config
    assert recompute_gated_activations(lean) == config.num_hidden_layers
    ids = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    kept, lean_kept = _saved_bytes(model, ids), _saved_bytes(lean, ids)
    assert kept - lean_kept == config.num_hidden_layers * ids.numel() * config.intermediate_size * 4
    grads = dict(model.named_parameters())
    for name, p in lean.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[name].grad), name


class _BiasAfterProduct(torch.nn.Module):
    """Has a gated MLP's parts but computes something else: left as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6)
        self.down_proj, self.act_fn = torch.nn.Linear(6, 4), torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) + 1)


def test_an_mlp_that_computes_something_else_is_left_as_it_was() -> None:
    odd = _BiasAfterProduct()
    assert recompute_gated_activations(odd) == 0
    assert "forward" not in odd.__dict__
    x = torch.randn(2, 4)
    expected = odd.down_proj(odd.act_fn(odd.gate_proj(x)) * odd.up_proj(x) + 1)
    assert torch.equal(odd(x), expected)


@pytest.mark.numerics
@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_a_step_with_mlp_activations_recomputed_is_the_same_step(lora: int) -> None:
    model, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    settings = {"optimizer": "sgd", "lr": 1.0, "micro_batch_size": 3, "lora": LoraSettings(rank=lora)}
    kept = PolicyTrainer(copy.deepcopy(model), TrainerConfig(**settings, recompute_mlp_activation=False))
    lean = PolicyTrainer(model, TrainerConfig(**settings))
    g = torch.Generator().manual_seed(4)
    rows, prompt, response = 6, 5, 7
    batch = TrainBatch(
        prompts=torch.randint(3, 300, (rows, prompt), generator=g),
        responses=torch.randint(3, 300, (rows, response), generator=g),
        response_mask=torch.ones(rows, response, dtype=torch.long),
        attention_mask=torch.ones(rows, prompt + response, dtype=torch.long),
        position_ids=torch.arange(prompt + response).repeat(rows, 1),
        logprobs=-torch.rand(rows, response, generator=g),
        advantages=torch.linspace(-1.0, 1.0, rows),
    )
    assert kept.step(batch, temperature=0.7) == lean.step(batch, temperature=0.7)
    after = dict(kept.model.named_parameters())
    for name, p in lean.model.named_parameters():
        assert torch.equal(p, after[name]), name
