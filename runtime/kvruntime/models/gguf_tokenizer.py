"""A GGUF's tokenizer: read from its own metadata (llama.cpp's `tokenizer.ggml.*` keys), built as the tokenizer
llama.cpp runs (byte-level BPE, or SentencePiece BPE with `<bos>` where the GGUF says), and the reference every load
of a converted model is checked against."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import KVRuntimeError

# Text the tokenizer must encode and decode back unchanged: spaces, a blank line, indentation, a tab, digits,
# punctuation and non-ASCII text exercise the byte-level pre-tokenizer and decoder.
ROUND_TRIP_PROBE = "Hello world! The pass key is 25613.\n\n    Indented,\ttabbed; naïve café — 日本語 «ok»."


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


BUILT_MODELS = ("gpt2", "llama")  # byte-level BPE (SmolLM2); SentencePiece BPE with byte fallback (Gemma)
USER_DEFINED_TOKEN = 4  # a token matched whole in the text, not special (Gemma's runs of newlines)


def build_tokenizer(spec: GGUFTokenizer) -> object:
    """A `tokenizers.Tokenizer` equal to the one llama.cpp runs for this GGUF: byte-level BPE from its merges, or
    SentencePiece BPE (byte fallback) whose merges its vocabulary implies. Built here, with no transformers converter,
    so every transformers version gets the same tokenizer (5.2's converter renamed a byte token of Gemma's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if spec.model not in BUILT_MODELS:
        raise KVRuntimeError(
            f"the GGUF has a {spec.model!r} tokenizer; only byte-level BPE (gpt2) and SentencePiece BPE (llama) are "
            "supported"
        )
    if spec.model == "gpt2":
        vocab = {token: index for index, token in enumerate(spec.tokens)}
        merges = [tuple(merge.split(" ", 1)) for merge in spec.merges]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=spec.add_space_prefix, use_regex=True)
        # llama.cpp's "smollm" pre-tokenizer splits digits one by one before the GPT-2 regex, as the original does.
        digits = [pre_tokenizers.Digits(individual_digits=True)] if spec.pre == "smollm" else []
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*digits, byte_level])
        tokenizer.decoder = decoders.ByteLevel()
    else:
        tokens = sentencepiece_spelling(spec.tokens)
        vocab = {token: index for index, token in enumerate(tokens)}
        unk = tokens[spec.unk_id]
        bpe = models.BPE(
            vocab=vocab, merges=sentencepiece_merges(tokens), fuse_unk=True, unk_token=unk, byte_fallback=True
        )
        tokenizer = Tokenizer(bpe)
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
        tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    if spec.add_bos:
        bos = spec.tokens[spec.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
        )
    elif spec.model == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(spec.tokens[i], special=True, normalized=False) for i in spec.special_ids])
    if spec.model == "llama":  # matched whole, as llama.cpp matches them
        user_defined = [i for i, kind in enumerate(spec.token_types) if kind == USER_DEFINED_TOKEN]
        tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])
    return tokenizer


def sentencepiece_spelling(tokens: Sequence[str]) -> list[str]:
    """A SentencePiece vocabulary as the tokenizer looks it up: a token of spaces only (a GGUF stores Gemma's runs
    of spaces as spaces) spelled with the space mark the normalizer turns spaces into."""
    return ["\u2581" * len(token) if token and not token.strip(" ") else token for token in tokens]


def sentencepiece_merges(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (a GGUF stores none): every split of a token into two
    tokens of the vocabulary merges into it, earlier tokens first (the file's order is the merge order), then the
    longer left piece, the longer right piece, and the pieces' own order in the vocabulary."""
    rank = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token in tokens:
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted(
            ((left, right) for left, right in splits if left in rank and right in rank),
            key=lambda pair: (-len(pair[0]), -len(pair[1]), rank[pair[0]], rank[pair[1]]),
        )
        merges += pairs
    return merges


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
