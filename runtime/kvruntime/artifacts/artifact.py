"""The artifact format every compile command writes and the runtime reads.

One safetensors file per artifact: tensors plus string metadata. The metadata says what the artifact is
(`kind`, `format_version`), which model it was compiled for (a `ModelFingerprint`), how it was made
(`provenance`: command, calibration data and its hash, seed, date) and kind-specific `params` (JSON).
A `checksum` over the tensors lets a corrupted file be told from a valid one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import nn

from ..errors import ArtifactError, first_line, short_repr
from ..files import write_atomically
from .artifact_header import FORMAT_NAME, FORMAT_VERSION, check_artifact_file
from .artifact_kinds import ARTIFACT_KINDS, KNOWN_KINDS
from .fingerprint import ModelFingerprint, check_compiled_for, model_fingerprint

T = TypeVar("T")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPES = {
    "integer": (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64),
    "numeric": (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, *_FLOATS),
}
_VALUE_RULES: dict[str, Callable[[torch.Tensor], bool]] = {
    "non-negative with a positive sum": lambda t: bool((t >= 0).all() and t.sum() > 0),
}


@dataclasses.dataclass
class Artifact:
    kind: str
    tensors: dict[str, torch.Tensor]
    model: ModelFingerprint
    provenance: dict[str, Any]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    path: Path | None = None


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def save_artifact(artifact: Artifact, path: str | os.PathLike) -> Path:
    """Write the artifact atomically (a crash never leaves a half-written artifact under the final name)."""
    _check_known_kind(artifact.kind, str(path))
    tensors = {name: t.detach().contiguous().cpu() for name, t in artifact.tensors.items()}
    _check_finite(tensors, str(path))
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "kind": artifact.kind,
        "model": json.dumps(artifact.model.to_dict(), sort_keys=True),
        "provenance": json.dumps(artifact.provenance, sort_keys=True),
        "params": json.dumps(artifact.params, sort_keys=True),
        "checksum": tensors_checksum(tensors),
    }
    return write_safetensors_atomically(tensors, metadata, path)


def write_safetensors_atomically(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str | os.PathLike
) -> Path:
    data = safetensors_bytes(tensors, metadata)
    return write_atomically(path, lambda tmp_name: Path(tmp_name).write_bytes(data))


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file whose bytes depend on its content alone: safetensors writes the metadata in hash-map
    order, which differs from run to run, so the header is written again with its keys sorted (the same command
    then gives the same bytes, which a bundle's manifest checks)."""
    data = safetensors_save(tensors, metadata)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


def read_artifact(path: str | os.PathLike) -> Artifact:
    """Read and validate the file itself (format, version, checksum, finite values, well-formed metadata of a known
    kind); no model is needed."""
    source = check_artifact_file(path)
    try:
        metadata, tensors = _read_safetensors(source.read_bytes())
    except Exception as exc:  # safetensors raises several types for truncated or foreign files
        raise ArtifactError(f"{source}: not a readable safetensors file ({first_line(exc)})") from None
    if metadata.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{source}: a safetensors file without kvcompile metadata (not a kvcompile artifact)")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise ArtifactError(
            f"{source}: artifact format version {short_repr(metadata.get('format_version'))}, this kvruntime reads "
            f"version {FORMAT_VERSION}; recompile it with this kvcompile"
        )
    if metadata.get("checksum") != tensors_checksum(tensors):
        raise ArtifactError(f"{source}: corrupted artifact (tensor checksum does not match its metadata)")
    _check_finite(tensors, str(source))
    missing = [key for key in ("kind", "model", "provenance", "params") if key not in metadata]
    try:
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        model = ModelFingerprint.from_dict(json.loads(metadata["model"]))
        provenance, params = (_json_object(metadata[key], key) for key in ("provenance", "params"))
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
        raise ArtifactError(f"{source}: malformed kvcompile metadata ({first_line(exc)})") from None
    _check_known_kind(metadata["kind"], str(source))
    return Artifact(
        kind=metadata["kind"], tensors=tensors, model=model, provenance=provenance, params=params, path=source
    )


def _read_safetensors(data: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors of one safetensors file's bytes. Read from one snapshot of the file: safe_open's torch
    backend reopens the file by name for the tensors, so a reader racing an atomic replacement could pair the old
    metadata with the new tensors (seen as a checksum mismatch)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("the header's metadata is not an object")
    return metadata, safetensors_load(data)


def _json_object(text: str, key: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{key} is a JSON {type(value).__name__}, not an object")
    return value


def load_artifact(
    path: str | os.PathLike | Artifact, model: nn.Module | None = None, kind: str | None = None, force: bool = False
) -> Artifact:
    """Read an artifact (or take one read already: `read_artifact` checked its file) and check it against the
    expected kind and the model it will be applied to, and that it holds the tensors the runtime reads from its kind
    (`artifact_kinds`).

    `force` accepts another checkpoint of the same shape (with a warning); a shape mismatch is always refused.
    """
    artifact = path if isinstance(path, Artifact) else read_artifact(path)
    if kind is not None:
        check_kind(artifact, kind)
    if model is not None:
        check_artifact_matches_model(artifact, model_fingerprint(model), force=force)
    check_tensors(artifact)
    return artifact


def check_tensors(artifact: Artifact) -> None:
    """Refuse an artifact that lacks a tensor the runtime reads from its kind, or holds one of another dtype, shape
    (against its own fingerprint) or range: one line naming the tensor instead of a crash inside a method."""
    fingerprint = artifact.model
    sizes = {
        "layers": fingerprint.num_layers,
        "query_heads": fingerprint.num_query_heads,
        "kv_heads": fingerprint.num_kv_heads,
    }
    problem = schema_problem(artifact.kind, artifact.tensors, sizes)
    if problem is not None:
        raise ArtifactError(f"{artifact.path}: {artifact.kind} tensor {problem}")


def schema_problem(kind: str, tensors: dict[str, torch.Tensor], sizes: dict[str, int]) -> str | None:
    """What breaks the kind's tensor rules (`artifact_kinds`), as "'name' is ...", or None. `sizes` binds sizes
    known beforehand (the model's); the others bind on first sight."""
    known = dict(sizes)
    for name, (values, shape, *rules) in ARTIFACT_KINDS[kind].tensors.items():
        tensor = tensors.get(name)
        if tensor is None:
            return f"{name!r} is missing"
        if tensor.dtype not in _DTYPES[values]:
            return f"{name!r} is {str(tensor.dtype).removeprefix('torch.')}, expected {values} values"
        before = dict(known)
        if not _shape_fits(tuple(tensor.shape), shape, known):
            expected = ", ".join(_describe_size(term, before) for term in shape)
            return f"{name!r} has shape {list(tensor.shape)}, expected [{expected}]"
        for rule in rules:
            if not _VALUE_RULES[rule](tensor):
                return f"{name!r} must be {rule}"
    return None


class ArtifactReader:
    """Base of a kind's reader class (`artifact_kinds`): what the runtime applies, built by `from_tensors`;
    `from_artifact` checks the kind, and a check that fails while building names the file."""

    kind: ClassVar[str]

    @classmethod
    def from_tensors(cls: type[T], tensors: dict[str, torch.Tensor], params: dict[str, Any]) -> T:
        raise NotImplementedError

    @classmethod
    def from_artifact(cls: type[T], artifact: Artifact) -> T:
        check_kind(artifact, cls.kind)
        try:
            return cls.from_tensors(artifact.tensors, artifact.params)
        except ArtifactError as exc:
            raise ArtifactError(f"{artifact.path}: {exc}") from None

    def check_schema(self, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse tensors that break the kind's rules among themselves (sizes that disagree)."""
        problem = schema_problem(self.kind, tensors, {})
        if problem is not None:
            raise ArtifactError(f"{self.kind.replace('_', ' ')} disagree: {problem}")


def _shape_fits(actual: tuple[int, ...], expected: tuple, sizes: dict[str, int]) -> bool:
    """Whether `actual` fits `expected` (see `artifact_kinds`); binds the names seen for the first time in `sizes`."""
    if len(actual) != len(expected):
        return False
    for size, term in zip(actual, expected):
        if isinstance(term, int):
            if size != term:
                return False
            continue
        name, less = _named_size(term)
        wanted = sizes.setdefault(name, size + less)
        if size + less != wanted or wanted < 1:
            return False
    return True


def _describe_size(term: int | str, sizes: dict[str, int]) -> str:
    if isinstance(term, int):
        return str(term)
    name, less = _named_size(term)
    return f"{term}={sizes[name] - less}" if name in sizes else term


def _named_size(term: str) -> tuple[str, int]:
    """ "ratios" -> ("ratios", 0); "entropy_bins-1" -> ("entropy_bins", 1): the size named, and how much less."""
    return (term[:-2], 1) if term.endswith("-1") else (term, 0)


def _check_known_kind(kind: str, where: str) -> None:
    if kind not in KNOWN_KINDS:
        raise ArtifactError(f"{where}: unknown artifact kind {short_repr(kind)} (known: {', '.join(KNOWN_KINDS)})")


def check_kind(artifact: Artifact, kind: str) -> None:
    if artifact.kind != kind:
        raise ArtifactError(f"{artifact.path}: artifact of kind {artifact.kind!r}, expected {kind!r}")


def check_artifact_matches_model(artifact: Artifact, model: ModelFingerprint, force: bool = False) -> None:
    check_compiled_for(artifact.model, artifact.kind, str(artifact.path), model, force)


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype in _FLOATS or tensor.is_complex():
            finite = torch.isfinite(tensor).all()
        elif tensor.is_floating_point():  # float8 and smaller: torch has no isfinite for them
            finite = torch.isfinite(tensor.float()).all()
        else:
            continue
        if not finite:
            raise ArtifactError(f"{where}: tensor {name!r} holds NaN or infinite values")
