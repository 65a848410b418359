"""``rlasync export``: a checkpoint as a folder other tools load, written whole or not at all.

    export_checkpoint(config, "newest", Path("out/merged"), merge=True)

A LoRA checkpoint (``adapter/``) exports as its adapter in PEFT's format, with its
``base_model_name_or_path`` set to the model the run started from (``PeftModel.from_pretrained``
and vLLM's ``--lora-modules`` load it), or with ``merge`` as one Hugging Face folder: the base
with the adapter merged in by peft itself (``merge_and_unload``), serving or fine-tuning as any
model. A full fine-tuning checkpoint exports as its model folder (there is nothing to merge).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..config import Config, ConfigError
from .evaluate import checkpoint_folder
from .model_dir import starting_model_dir


def export_checkpoint(config: Config, checkpoint: str, out: Path, *, merge: bool = False) -> Path:
    """Write ``checkpoint`` (a folder, or ``newest`` in ``train.run_dir``) of the run ``config``
    describes into ``out`` (which must not exist); returns ``out``."""
    if out.exists():
        raise ConfigError(f"--out {out} exists: remove it or name another folder")
    folder = checkpoint_folder(config, checkpoint)
    adapter = folder / "adapter"
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if not adapter.is_dir():
        shutil.copytree(folder / "model", partial)
    else:
        from ..models import load_pretrained_dir
        from ..models.tiny import load_tokenizer

        base = starting_model_dir(config).resolve()
        if merge:  # only a merge needs the base's weights; the adapter alone points at them
            try:
                import peft
            except ImportError:
                raise ConfigError("rlasync export --merge needs peft: pip install 'rlasync[lora]'") from None
            merged = peft.PeftModel.from_pretrained(load_pretrained_dir(base)[0], adapter).merge_and_unload()
            merged.save_pretrained(partial, safe_serialization=True)
        else:
            shutil.copytree(adapter, partial)
            settings = json.loads((partial / "adapter_config.json").read_text())
            settings["base_model_name_or_path"] = str(base)
            (partial / "adapter_config.json").write_text(json.dumps(settings, indent=2))
        load_tokenizer(base).save_pretrained(partial)
    partial.rename(out)
    return out
