"""LoRA adapters on the trainer (``trainer.lora``), with peft: the base model frozen, a low-rank
``B @ A`` (times ``alpha / rank``) learned beside each targeted linear layer.

    model = wrap(model, LoraSettings(rank=16, alpha=32))      # a peft model: only adapters train
    weights = merged(dict(model.named_parameters()), scaling(model))   # what engines load

A weight sync sends engines the adapters alone (``trainer.lora.sync: adapter``, the default):
``sync_tensors`` names them ``<layer>.lora_A.weight``/``<layer>.lora_B.weight`` after the base
model's layers (PEFT's file names without its prefix), and each engine adds ``alpha/rank B A`` to
the base weights it started from (``rlasync.weights.adapters``). With ``sync: merged`` engines
load the merged model under the base model's own names (``W + alpha/rank B A`` for each adapted
layer, every other weight as it is), as for a run without LoRA. A checkpoint holds the merged
model (``model/``: serve or evaluate it as any model folder) and the adapter in PEFT's format (``adapter/``: ``adapter_model.safetensors`` and
``adapter_config.json``, loadable with ``PeftModel.from_pretrained``); resuming reads the adapter
back onto the base the run starts from, after checking that base is the one the checkpoint's
merged model was made from (every weight no adapter changes, bit for bit).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config.train import LoraSettings
from .state import iter_safetensors

PREFIX = "base_model.model."
"""What peft puts before the base model's parameter names."""
INIT_SEED = 0
"""The seed the adapters are initialised from (B at zero, A at random), the same on every rank."""
ADAPTER = "default"
"""peft's name of the one adapter (it sits in the parameter names: ``lora_A.default.weight``)."""


def wrap(model: Any, settings: LoraSettings) -> Any:
    """``model`` with LoRA adapters on ``settings.target_modules`` (a peft ``PeftModel``)."""
    if importlib.util.find_spec("peft") is None:
        raise ValueError("trainer.lora needs the peft package: pip install 'rlasync[lora]'")
    import peft

    targets: str | list[str] = settings.target_modules
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
    )
    device = next(model.parameters()).device
    # A is initialised at random: from one seed, so every rank starts from the same adapters
    # (and the in-process trainer from the ranks' ones), whatever each process drew before.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(INIT_SEED)
        try:
            return peft.get_peft_model(model, config)
        except ValueError as exc:  # no module matches target_modules, and the like
            raise ValueError(f"trainer.lora: {exc}") from None


def scaling(model: Any) -> float:
    """``alpha / rank`` of the model's adapter."""
    config = model.peft_config[ADAPTER]
    return float(config.lora_alpha) / float(config.r)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A peft parameter name as the base model names it."""
    name = name.removeprefix(PREFIX)
    return name.replace(".base_layer.", ".")


def merged(named: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base model's parameters by its own names, each adapted weight merged with its adapter
    (``named``: a peft model's parameters or full state dict, on the CPU or not)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        if is_adapter(name):
            continue
        out[base_name(name)] = tensor
    for name, a in named.items():
        if f".lora_A.{ADAPTER}." not in name:
            continue
        layer = name.split(f".lora_A.{ADAPTER}.")[0]
        b = named[f"{layer}.lora_B.{ADAPTER}.weight"]
        target = base_name(f"{layer}.weight")
        out[target] = out[target] + scale * (b.to(out[target].dtype) @ a.to(out[target].dtype))
    return out


def sync_name(name: str) -> str:
    """An adapter parameter's name in a weight sync: ``<base layer>.lora_A.weight``."""
    return base_name(name).replace(f".{ADAPTER}.", ".")


def sync_tensors(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a peft model's parameters, as a weight sync sends them (``sync_name``)."""
    return {sync_name(name): tensor for name, tensor in named.items() if is_adapter(name)}


def adapter_state(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a peft model's state, by their peft names."""
    return {name: tensor for name, tensor in named.items() if is_adapter(name)}


def unadapted(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base parameters no adapter changes (embeddings, norms, untargeted layers), by the
    base model's names: what a merged model of this base holds bit for bit."""
    return {
        base_name(name): tensor
        for name, tensor in named.items()
        if not is_adapter(name) and ".base_layer." not in name
    }


def check_base(model: Any, merged: Path) -> None:
    """Adapters fit only the base they were trained on: the merged model a checkpoint holds
    (the folder ``merged``) must hold ``model``'s base weights wherever no adapter changed them,
    bit for bit. A ValueError names the first that differs. Every rank calls it: a shard is
    gathered whole (collective), one tensor at a time in the file's order."""
    mine = unadapted({n: p.detach() for n, p in model.named_parameters()})
    for name, saved in iter_safetensors(merged, mine):
        tensor = mine[name]
        tensor = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu()
        if not torch.equal(saved.to(tensor.dtype), tensor):
            raise ValueError(
                f"checkpoint {merged.parent} was trained on another base model: its {name} differs from "
                "this run's (LoRA adapters fit only the base they were trained on): resume with the "
                "train.model_dir it was trained from, or start without --resume"
            )


def from_saved(saved: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter file (``adapter_model.safetensors``) by the parameter names
    of the peft model (PEFT's files leave the adapter's name out)."""
    out = {}
    for name, tensor in saved.items():
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(f"{part}weight", f"{part}{ADAPTER}.weight")
        out[name] = tensor
    return out
