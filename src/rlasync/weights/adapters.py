"""LoRA adapters a weight sync sends instead of weights (``BucketPlan.lora_scale``, the trainer's
``trainer.lora.sync: adapter``), taken on the engine's side.

    adapters = engine_adapters(engine, plan)          # at attach: how this engine takes them
    staged = adapters.prepare(received)                # at staging, while the engine decodes
    await adapters.take(engine, staged, version)       # at the commit, inside the engine's pause

A version is the adapters alone, ``<layer>.lora_A.weight`` (rank x in) and ``<layer>.lora_B.weight``
(out x rank) for each adapted layer: tens of MB where the model is GBs. An engine takes them one
of two ways:

- ``MergedAdapters``, for an engine whose model lives in this process (the torch engine): each
  adapted layer's weight becomes ``W0 + scale * B @ A``, computed from the base weights ``W0`` the
  engine started from, at staging (off the pause), and swapped in like a full version's tensors.
  The base is kept by reference when the engine swaps by reference (``swap_weights`` puts new
  tensors in place and never writes into the old ones), else copied once. Merging beats applying
  the adapters on the fly in the engine's forward: decoding then runs the plain model, not two more
  matmuls per adapted layer at every step (``benchmarks/lora_bench.py`` measures both).
- ``LoadedAdapters``, for an engine with ``load_adapter`` (vLLM and SGLang, with their own LoRA
  support): the tensors are handed to it, which serves every later request with them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from .buckets import BucketPlan
from .errors import SyncError

A, B = ".lora_A.weight", ".lora_B.weight"


def adapted_layers(plan: BucketPlan) -> list[str]:
    """The layers a plan of adapters adapts, in its order (each has an A and a B)."""
    names = {spec.name for spec in plan.tensors}
    layers = sorted(name.removesuffix(A) for name in names if name.endswith(A))
    pairs = {f"{layer}{end}" for layer in layers for end in (A, B)}
    if names != pairs:
        raise SyncError(f"a LoRA plan holds tensors that are not A/B pairs: {sorted(names ^ pairs)[:5]}")
    return layers


class EngineAdapters(Protocol):
    def prepare(self, adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    async def take(self, engine: Any, staged: Mapping[str, torch.Tensor], version: int) -> float | None: ...


class MergedAdapters:
    """Adapters merged into the engine's own weights: ``W0 + scale * B @ A`` per adapted layer."""

    def __init__(self, base: Mapping[str, torch.Tensor], scale: float) -> None:
        self.base = dict(base)  # "<layer>.weight" -> W0
        self.scale = scale

    @classmethod
    def of(cls, engine: Any, plan: BucketPlan) -> MergedAdapters:
        if int(getattr(engine, "weight_version", 0)) != 0:  # W0 must be the base, not a merged version
            raise SyncError(
                f"LoRA adapters merge into the base weights an engine starts from; this one already serves "
                f"weight version {engine.weight_version} (attach the sync before its first version)"
            )
        params = dict(engine.model.named_parameters())
        keep = hasattr(engine, "swap_weights")  # new tensors go in; W0's memory is never written
        base = {}
        for layer in adapted_layers(plan):
            weight = params.get(f"{layer}.weight")
            if weight is None:
                raise SyncError(
                    f"the trainer sends a LoRA adapter for {layer}, which this engine's model does not have "
                    "(the engines must start from the trainer's base model)"
                )
            base[f"{layer}.weight"] = weight.detach() if keep else weight.detach().clone()
        return cls(base, plan.lora_scale)

    def prepare(self, adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The merged weights of every adapted layer, as new tensors (in W0's dtype, on its device)."""
        with torch.no_grad():
            out = {}
            for name, w0 in self.base.items():
                layer = name.removesuffix(".weight")
                a, b = adapters[f"{layer}{A}"].to(w0), adapters[f"{layer}{B}"].to(w0)
                out[name] = torch.addmm(w0, b, a, alpha=self.scale)
            return out

    async def take(self, engine: Any, staged: Mapping[str, torch.Tensor], version: int) -> float | None:
        if hasattr(engine, "swap_weights"):  # the merged tensors are new: handed over by reference
            return float(await engine.swap_weights(staged, version))
        await engine.update_weights(staged, version)
        return None


class LoadedAdapters:
    """Adapters the engine applies itself (``load_adapter``: vLLM's or SGLang's LoRA support)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def prepare(self, adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(adapters)

    async def take(self, engine: Any, staged: Mapping[str, torch.Tensor], version: int) -> float | None:
        await engine.load_adapter(staged, self.scale, version)
        return None


def write_peft_adapter(folder: Path, adapters: Mapping[str, torch.Tensor], scale: float) -> Path:
    """``adapters`` (a sync's names) as a PEFT adapter folder: ``adapter_model.safetensors`` under
    PEFT's names and ``adapter_config.json`` (rank, ``lora_alpha = scale * rank``, the adapted
    modules), what vLLM's and SGLang's LoRA support load."""
    from safetensors.torch import save_file

    layers = sorted({name.removesuffix(A).removesuffix(B) for name in adapters})
    rank = int(adapters[f"{layers[0]}{A}"].shape[0])
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{name}": t.detach().contiguous().cpu() for name, t in adapters.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": round(scale * rank),
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in layers}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


class AdapterFolders:
    """An engine's versions of a LoRA adapter as PEFT folders (``write_peft_adapter``), in a
    temporary directory of its own: what vLLM and SGLang load by path. The newest is kept, the
    one before it removed once the engine has loaded the newest."""

    def __init__(self) -> None:
        self._root: tempfile.TemporaryDirectory[str] | None = None
        self.current: Path | None = None

    async def write(self, adapters: Mapping[str, torch.Tensor], scale: float, version: int) -> Path:
        if self._root is None:
            self._root = tempfile.TemporaryDirectory(prefix="rlasync-lora-")
        folder = Path(self._root.name) / f"v{version}"
        return await asyncio.to_thread(write_peft_adapter, folder, adapters, scale)

    def loaded(self, folder: Path) -> None:
        """The engine serves ``folder`` now: the previous version's files go."""
        if self.current is not None and self.current != folder:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = folder

    def close(self) -> None:
        if self._root is not None:
            self._root.cleanup()


def engine_adapters(engine: Any, plan: BucketPlan) -> EngineAdapters:
    """How ``engine`` takes the adapters of ``plan``: loaded by the engine if it can, else merged
    into its model's weights; an engine with neither is a ``SyncError`` naming the setting."""
    if hasattr(engine, "load_adapter"):
        return LoadedAdapters(plan.lora_scale)
    if isinstance(getattr(engine, "model", None), torch.nn.Module):
        return MergedAdapters.of(engine, plan)
    raise SyncError(
        f"{type(engine).__name__} cannot take LoRA adapters from the trainer: set trainer.lora.sync=merged "
        "(engines then load the merged model)"
    )
