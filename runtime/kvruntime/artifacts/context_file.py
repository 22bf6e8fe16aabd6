"""A compressed context saved to a file (`kvruntime.save_context`; `kvcompile generate --save-context`): a kvcompile
artifact of kind `compressed_context`, whose tensors are each cache layer's kept keys and values (`keys.<layer>`,
`values.<layer>`), their original positions (`positions.<layer>`) and, where a layer's heads show fewer entries than
its slots, its keep mask (`keep_mask.<layer>`). Its header is read and checked here, torch-free, before anything
loads: a file is anyone's, and nothing it says is used before it is checked. Its tensors are checked against the
model where they load (`engine/saved_context.py`)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, first_line, printable
from .artifact_header import FORMAT_VERSION, check_artifact_file, header_of, load_json
from .fingerprint import ModelFingerprint

CONTEXT_KIND = "compressed_context"
PROMPT_FORMATS = ("chat", "raw")
QUESTION_SEPARATORS = ("", "\n", "\n\n")  # what goes between a saved context and a question (`generate`'s rule)
PER_LAYER = ("keys", "values", "positions", "keep_mask")
FLOAT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}
_DTYPE_BYTES = {**FLOAT_DTYPES, "I32": 4, "I64": 8, "BOOL": 1}
_TENSOR_NAME = re.compile(r"(keys|values|positions|keep_mask)\.(0|[1-9][0-9]{0,3})")


@dataclasses.dataclass(frozen=True)
class ContextHeader:
    """What a context file's header says, checked: the model it was made for, its prompt and how it was made, and
    each tensor's dtype and shape."""

    path: Path
    model: ModelFingerprint
    context_length: int  # the document's tokens: a question's positions start after them
    layers: int  # the cache's layers: the model's, sliding ones included (a fingerprint counts the cut ones)
    prompt_format: str  # chat (the model's chat template, the user's turn left open) or raw
    question_separator: str  # between the context and a question's text
    tokenizer_sha256: str
    method: str
    requested: str  # the ratio or budget, as the report says it
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)

    def describe(self) -> str:
        """What the file was made for, in a refusal."""
        model = self.model
        return (
            f"{self.path} was made for {printable(model.architecture)} weights {printable(model.weights_hash)} "
            f"({self.layers} layers x {model.num_kv_heads} KV heads)"
        )


def read_context_header(path: str | os.PathLike) -> ContextHeader:
    """The header of a context file, checked as far as it goes without the model: a kvcompile artifact of this
    kind and format, its parameters well formed, its tensors named, typed and shaped as a context's, and their
    declared bytes within the file. One line (ArtifactError) for anything else."""
    source = check_artifact_file(path)
    try:
        with open(source, "rb") as handle:
            header, start = header_of(handle, source)
    except OSError as exc:
        raise ArtifactError(f"{source}: not a readable context file ({first_line(exc)})") from None
    metadata = header.pop("__metadata__")
    if metadata.get("kind") != CONTEXT_KIND:
        raise ArtifactError(f"{source}: a {printable(str(metadata.get('kind')))} artifact, not a saved context")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise ArtifactError(f"{source}: a context file of another format version: save it again with this kvruntime")
    try:
        model = ModelFingerprint.from_dict(load_json(metadata.get("model", "")))
        params = load_json(metadata.get("params", ""))
        fields = _context_fields(params)
        tensors = _tensor_entries(header, source.stat().st_size - start)
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise ArtifactError(f"{source}: malformed context file ({first_line(exc)})") from None
    context = ContextHeader(path=source, model=model, tensors=tensors, **fields)
    _check_shapes(context)
    return context


def _context_fields(params: Any) -> dict[str, Any]:
    """The context's parameters, each of its type and in its range."""
    if not isinstance(params, dict):
        raise ValueError("params is not an object")
    length = params["context_length"]
    if not isinstance(length, int) or isinstance(length, bool) or not 2 <= length < 1 << 24:
        raise ValueError(f"context_length {printable(repr(length))} is not a token count")
    layers = params["layers"]
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= 1024:
        raise ValueError(f"layers {printable(repr(layers))} is not a layer count")
    if params["prompt_format"] not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format {printable(repr(params['prompt_format']))} is not chat or raw")
    if params["question_separator"] not in QUESTION_SEPARATORS:
        raise ValueError("question_separator is not one a context is saved with")
    sha = params["tokenizer_sha256"]
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ValueError("tokenizer_sha256 is not a sha256")
    method, requested = params["method"], params["requested"]
    if not isinstance(method, str) or not isinstance(requested, str) or len(method) + len(requested) > 400:
        raise ValueError("method and requested are not short texts")
    return {
        "context_length": length,
        "layers": layers,
        "prompt_format": params["prompt_format"],
        "question_separator": params["question_separator"],
        "tokenizer_sha256": sha,
        "method": method,
        "requested": requested,
    }


def _tensor_entries(header: dict[str, Any], data_bytes: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape, its name one of a context's and its declared bytes its shape's, laid end to
    end within the `data_bytes` the file holds after its header."""
    entries, spans = {}, []
    for name, entry in header.items():
        if not _TENSOR_NAME.fullmatch(name):
            raise ValueError(f"a tensor named {printable(repr(name))[:80]}, not a context's")
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype not in _DTYPE_BYTES or not all(isinstance(n, int) and 0 <= n < 1 << 32 for n in shape):
            raise ValueError(
                f"tensor {name} of dtype {printable(str(dtype))[:20]} and shape {printable(str(shape))[:80]}"
            )
        size = _DTYPE_BYTES[dtype]
        for n in shape:
            size *= n
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin and end - begin == size):
            raise ValueError(f"tensor {name} declares {end - begin} bytes for a shape of {size}")
        entries[name] = (dtype, shape)
        spans.append((begin, end))
    spans.sort()
    if any(first[1] != second[0] for first, second in zip(spans, spans[1:])) or (spans and spans[0][0] != 0):
        raise ValueError("tensors that overlap or leave gaps")
    declared = spans[-1][1] if spans else 0
    if declared != data_bytes:
        raise ValueError(f"its tensors declare {declared} bytes, the file holds {data_bytes} after its header")
    return entries


def _check_shapes(context: ContextHeader) -> None:
    """Every layer of the cache its file names: keys and values [1, KV heads, slots, head dim] of one float dtype,
    between 1 and the context's tokens slots; positions [1, KV heads, slots] of integers; a keep mask, where given,
    the same shape in booleans."""
    model, tensors, path = context.model, context.tensors, context.path
    expected = {f"{kind}.{layer}" for layer in range(context.layers) for kind in PER_LAYER[:3]}
    masks = {name for name in tensors if name.startswith("keep_mask.")}
    if set(tensors) - masks != expected or not {name.replace("keep_mask", "keys") for name in masks} <= expected:
        missing = sorted(expected - set(tensors))[:3]
        raise ArtifactError(f"{path}: not the tensors of a {context.layers}-layer context (missing {missing})")
    dtypes = {tensors[f"keys.{layer}"][0] for layer in range(context.layers)}
    if len(dtypes) != 1 or not dtypes <= set(FLOAT_DTYPES):
        raise ArtifactError(f"{path}: keys of dtypes {sorted(dtypes)}: one of F32, BF16 or F16 in every layer")
    for layer in range(context.layers):
        shape = tensors[f"keys.{layer}"][1]
        slots = shape[2] if len(shape) == 4 else 0
        entry = (1, model.num_kv_heads, slots, model.head_dim)
        wanted = {"keys": (dtypes, entry), "values": (dtypes, entry), "positions": ({"I32", "I64"}, entry[:3]),
                  "keep_mask": ({"BOOL"}, entry[:3])}  # fmt: skip
        for kind, (allowed, wanted_shape) in wanted.items():
            name = f"{kind}.{layer}"
            if name in tensors and (tensors[name][0] not in allowed or tensors[name][1] != wanted_shape):
                dtype, shape = tensors[name]
                raise ArtifactError(
                    f"{path}: tensor {name} is {dtype} {list(shape)}, where this context needs "
                    f"{'/'.join(sorted(allowed))} {list(wanted_shape)}"
                )
        if not 1 <= slots <= context.context_length:
            raise ArtifactError(
                f"{path}: layer {layer} holds {slots} entries per head of a {context.context_length}-token context"
            )


def check_context_model(context: ContextHeader, model: ModelFingerprint) -> None:
    """Refuse a context made for other weights than `model`'s, in one line that says what it was made for."""
    if context.model != model:
        raise ArtifactError(
            f"{context.describe()}, not for this model ({printable(model.architecture)} weights "
            f"{printable(model.weights_hash)}): save it again from this model"
        )
