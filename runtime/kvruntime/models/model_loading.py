"""Loading the model to compress: a shipped model by name (`default`, SmolLM2-135M-Instruct, or `gemma-3-270m`: GGUFs
in packages, see `default_model`), a GGUF file, a local Hugging Face model directory, or a hub id already in the
local cache. Never downloads."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import KVRuntimeError, first_line, printable
from .default_model import (
    DEFAULT_MODEL,
    SHIPPED_MODELS,
    converted_gguf,
    gguf_of,
    load_gguf_model,
    load_shipped_model,
)
from .model_spec import check_model_spec


def load_model(
    model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode, offline."""
    if model in SHIPPED_MODELS:
        return load_shipped_model(model, lambda folder: _load_folder(folder, dtype))
    check_model_spec(model)  # a GGUF file's header, a folder's code, weights and config: refused before loading
    folder = Path(model)
    if folder.is_file():  # a GGUF by its magic (`check_model_spec`), whatever its name
        return load_gguf_model(folder.resolve(), folder.stem, lambda cached: _load_folder(cached, dtype))
    try:
        return _load_folder(folder, dtype)
    except KVRuntimeError:
        raise
    except Exception as exc:  # transformers, tokenizers and safetensors raise many types for a broken folder
        raise KVRuntimeError(
            f"cannot load model {model!r} offline ({first_line(exc)}); nothing is downloaded at run time: give a complete "
            "local model directory (config, weights and tokenizer) or a model in the Hugging Face cache"
        ) from None


def weights_folder(model: str) -> Path | None:
    """The folder whose files hold the model's weights, read before the model loads (its fingerprint,
    `kvruntime.artifacts.fingerprint.folder_fingerprint`): a GGUF's (a shipped model's included) converted cache,
    converted first where it is not there; a folder as given; a hub id's snapshot in the local cache; else None."""
    if model in SHIPPED_MODELS:
        return converted_gguf(gguf_of(model), SHIPPED_MODELS[model].title)
    check_model_spec(model)
    given = Path(model)
    if given.is_file():
        return converted_gguf(given.resolve(), given.stem)
    if given.is_dir():
        return given
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001  not in the local cache, or not a hub id: known once loaded
        return None


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of a folder, never running code of its own, and refused where some weights are
    missing (transformers would initialise them at random behind a warning)."""
    loaded, info = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, output_loading_info=True, local_files_only=True, trust_remote_code=False
    )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise KVRuntimeError(
            f"model {printable(folder)} lacks {len(missing)} of its weights ({printable(missing[0])}, ...): a model "
            "is never run with random ones"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    loaded.eval()
    return loaded, tokenizer
