"""What SGLang does between requests for a run, as a part of ``SGLangEngine``: LoRA adapters a
weight sync sends, loaded by path (``load_adapter``), and its GPU memory released while a
colocated trainer steps (``sleep``/``wake_up``, SGLang's memory saver). GPU only: the fake SGLang
the CPU tests use has neither."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping
from typing import Any

from ..weights.adapters import AdapterFolders
from .protocol import EngineError


class SGLangBetweenRequests:
    # The engine's own state these read and set (``SGLangEngine.__init__`` makes it).
    engine: Any
    _tm: Any  # its tokenizer manager
    _by_id: dict[str, Any]  # requests not yet ended
    _version: int
    _lora: str
    _lora_files: AdapterFolders
    _asleep: list[str]

    async def load_adapter(self, adapters: Mapping[str, Any], scale: float, version: int) -> None:
        """Serve every request from now on with the LoRA ``adapters`` (a weight sync's names) times
        ``scale``, through SGLang's own LoRA support (``enable_lora`` and ``max_lora_rank`` in
        ``engine.engine_kwargs``; GPU only): written as a PEFT folder, loaded under a name of its
        version, and the previous version's unloaded."""
        if not getattr(getattr(self.engine, "server_args", None), "enable_lora", False):
            raise EngineError(
                "load_adapter: SGLang was started without LoRA: add enable_lora: true and max_lora_rank to "
                "engine.engine_kwargs, or set trainer.lora.sync=merged"
            )
        io_struct = importlib.import_module("sglang.srt.managers.io_struct")
        folder = await self._lora_files.write(adapters, scale, version)
        name = f"rlasync-v{version}"
        load = io_struct.LoadLoRAAdapterReqInput(lora_name=name, lora_path=str(folder))
        result = await self._tm.load_lora_adapter(load, None)
        if not getattr(result, "success", True):
            raise EngineError(
                f"load_adapter: SGLang did not load the adapter: {getattr(result, 'error_message', '')}"
            )
        previous, self._lora, self._version = self._lora, name, version
        if previous:  # requests admitted from now on use the new one
            unload = io_struct.UnloadLoRAAdapterReqInput(lora_name=previous)
            with contextlib.suppress(Exception):  # still in use by a running request: it stays loaded
                await self._tm.unload_lora_adapter(unload, None)
        self._lora_files.loaded(folder)

    async def sleep(self, offload_weights: bool = False) -> None:
        """(``SleepingEngine``, GPU only: SGLang's memory saver, ``enable_memory_saver`` in
        ``engine.engine_kwargs``) Its KV cache released, and with ``offload_weights`` its weights."""
        if self._by_id:
            raise EngineError(f"sleep with {len(self._by_id)} requests running: pause the engine first")
        io_struct = importlib.import_module("sglang.srt.managers.io_struct")
        tags = ["kv_cache", "weights"] if offload_weights else ["kv_cache"]
        await self._tm.release_memory_occupation(io_struct.ReleaseMemoryOccupationReqInput(tags=tags), None)
        self._asleep = tags

    async def wake_up(self) -> None:
        if self._asleep:
            io_struct = importlib.import_module("sglang.srt.managers.io_struct")
            await self._tm.resume_memory_occupation(
                io_struct.ResumeMemoryOccupationReqInput(tags=self._asleep), None
            )
        self._asleep = []
