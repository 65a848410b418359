"""The trainer's state as a checkpoint holds it: copies of the model's and the optimiser's
tensors, laid out as ``torch.distributed.checkpoint`` lays out a whole model's (optimiser state
and groups keyed by parameter name), the model folder's tensors read back, and a rank's RNGs."""

from __future__ import annotations

import json
import random
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import torch


def whole_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "optimizer"}`` of an unsharded model, as copies on the CPU (training may go on
    while they are written)."""
    name = {id(p): n for n, p in model.named_parameters()}
    order = [
        name[id(p)] for group in optimizer.param_groups for p in group["params"]
    ]  # the optimizer's own indices
    saved = optimizer.state_dict()
    optimizer_state = {
        "state": {
            order[i]: {
                k: v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
            for i, state in saved["state"].items()
        },
        "param_groups": [
            {**group, "params": [order[i] for i in group["params"]]} for group in saved["param_groups"]
        ],
    }
    model_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return {"model": model_state, "optimizer": optimizer_state}


def owned(value: Any, live: set[int]) -> Any:
    """``value`` (a state dict, nested) with every tensor whose memory is in ``live`` (the data
    pointers of the model's and the optimiser's own tensors) copied: what is left can no longer
    change under the training that goes on."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.data_ptr() in live else value
    if isinstance(value, dict):
        return {k: owned(v, live) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(owned(v, live) for v in value)
    return value


def iter_safetensors(folder: Path, names: Container[str] | None = None) -> Iterator[tuple[str, Any]]:
    """The tensors of a Hugging Face folder's weights (``model.safetensors``, or every shard its
    ``model.safetensors.index.json`` names), one at a time and in the same order on every call:
    all, or those of ``names`` it holds (the files are mapped, so the others are not read)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    for file in files:
        with safe_open(str(folder / file), framework="pt") as saved:
            for name in saved.keys():
                if names is None or name in names:
                    yield name, saved.get_tensor(name)


def read_safetensors(folder: Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face folder's weights, by name (``iter_safetensors``)."""
    return dict(iter_safetensors(folder))


def rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA) and Python random states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
