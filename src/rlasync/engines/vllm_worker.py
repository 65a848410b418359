"""Methods rlasync adds to vLLM's workers (``worker_extension_cls``), called by ``collective_rpc``.

vLLM runs its model in an engine-core process of its own; these run there, between two
scheduler steps, with the worker as ``self``.
"""

from __future__ import annotations


class WeightLoader:
    def rlasync_load_weights(self, payload: bytes) -> int:
        """Load Hugging Face-named tensors (a safetensors blob: vLLM's RPC encoding turns
        tensors into lists) through the model runner's in-place ``reload_weights``: it maps
        checkpoint names to fused layers (e.g. qkv_proj) and redoes the post-load processing
        (on CPU, weights are repacked after loading and the original parameters emptied, so
        the model's plain ``load_weights`` cannot be called twice)."""
        from safetensors.torch import load

        weights = load(payload)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(weights)
