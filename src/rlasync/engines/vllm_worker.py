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
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        _repack_cpu_embeddings(runner.get_model())
        return len(weights)


def _repack_cpu_embeddings(model: object) -> int:
    """On CPU, vLLM gives a tied ``lm_head`` (the input embedding, used as the output layer) a
    packed copy of its weight once, after the first load; ``reload_weights`` refreshes the
    embedding but not that copy, so the logits kept coming from the old embedding (measured:
    logprobs off by up to 0.8 after an update). Repack every layer that keeps its weight next
    to a packed copy. Returns how many were repacked."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = 0
    for module in model.modules():  # type: ignore[attr-defined]
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.dim() == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked
