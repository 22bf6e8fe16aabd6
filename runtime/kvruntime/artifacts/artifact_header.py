"""An artifact's header read without torch: its format marker and metadata (kind, model, params), what the command
line checks before it imports anything heavy. `artifact.read_artifact` reads and checks the whole file."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, first_line

FORMAT_NAME = "kvcompile-artifact"
FORMAT_VERSION = 1
ARTIFACT_SUFFIX = ".safetensors"
_LARGEST_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_ARRAY_CODES = {"I64": "q", "I32": "i", "F64": "d", "F32": "f"}  # safetensors dtype -> array typecode
# The headers read inside a `headers_read_once` block, by file (None outside one).
_HEADERS_READ: contextvars.ContextVar[dict[Path, tuple[dict[str, Any], int]] | None] = contextvars.ContextVar(
    "headers_read", default=None
)


def artifact_file_name(kind: str) -> str:
    """What kvcompile names an artifact of `kind` in a model's folder or a bundle: `<kind>.safetensors`."""
    return f"{kind}{ARTIFACT_SUFFIX}"


def check_artifact_file(path: str | os.PathLike) -> Path:
    """Refuse a path that is not a regular file (missing, a folder, a device or a pipe)."""
    source = Path(path)
    if source.is_dir():
        raise ArtifactError(f"{source} is a folder: give an artifact file (.safetensors)")
    if not source.exists():
        raise ArtifactError(f"{source}: no such artifact file")
    if not source.is_file():
        raise ArtifactError(f"{source} is not a regular file: give an artifact file (.safetensors)")
    return source


@contextlib.contextmanager
def headers_read_once() -> Iterator[None]:
    """Inside the block each artifact file's header is read once, and that header answers every later ask: the checks
    of one request see the bytes the first read found (a block inside another one shares its headers)."""
    if _HEADERS_READ.get() is not None:
        yield
        return
    token = _HEADERS_READ.set({})
    try:
        yield
    finally:
        _HEADERS_READ.reset(token)


def read_header(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a kvcompile artifact (kind, model, params, ...), from its header alone."""
    return _held_header(check_artifact_file(path))[0].get("__metadata__")


def header_params(path: str | os.PathLike) -> dict[str, Any]:
    """The artifact's params (its settings and what was learned beyond the tensors)."""
    try:
        params = json.loads(read_header(path).get("params", "{}"))
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"{path}: malformed kvcompile metadata ({first_line(exc)})") from None
    if not isinstance(params, dict):
        raise ArtifactError(f"{path}: malformed kvcompile metadata (params is not an object)")
    return params


def small_tensor_values(path: str | os.PathLike, name: str) -> list[float]:
    """The values of one small numeric tensor of the artifact (compiled budgets, compiled ratios), flattened."""
    source = check_artifact_file(path)
    header, start = _held_header(source)
    entry = header.get(name)
    try:
        code = _ARRAY_CODES[entry["dtype"]]
        begin, end = (int(offset) for offset in entry["data_offsets"])
        with open(source, "rb") as handle:
            handle.seek(start + begin)
            values = array(code, handle.read(end - begin))
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{source}: no readable tensor {name!r} ({first_line(exc)})") from None
    if sys.byteorder == "big":  # safetensors is little-endian
        values.byteswap()
    return values.tolist()


def _held_header(source: Path) -> tuple[dict[str, Any], int]:
    """`_header`, read once per file inside a `headers_read_once` block."""
    held = _HEADERS_READ.get()
    if held is None:
        return _header(source)
    key = source.resolve()
    if key not in held:
        held[key] = _header(source)
    return held[key]


def _header(source: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a kvcompile artifact and where its data starts."""
    try:
        with open(source, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= _LARGEST_HEADER:
                raise ValueError("no safetensors header")
            header = json.loads(handle.read(size))
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise ValueError("the header's metadata is not an object")
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        raise ArtifactError(f"{source}: not a readable safetensors file ({first_line(exc)})") from None
    if metadata.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{source}: a safetensors file without kvcompile metadata (not a kvcompile artifact)")
    return {**header, "__metadata__": metadata}, 8 + size


def header_kind(path: str | os.PathLike) -> str | None:
    """The kind a file's header names, None when it is not a readable kvcompile artifact."""
    try:
        return read_header(path).get("kind")
    except ArtifactError:
        return None
