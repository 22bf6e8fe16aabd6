"""An artifact's header read without torch: its format marker and metadata (kind, model, params), what the command
line checks before it imports anything heavy. `artifact.read_artifact` reads and checks the whole file."""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import os
import stat
import sys
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ArtifactError, first_line, short_repr

FORMAT_NAME = "kvcompile-artifact"
FORMAT_VERSION = 1
ARTIFACT_SUFFIX = ".safetensors"
_LARGEST_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
# No number kvcompile writes has more digits: Python reads up to 4300, and a 401-digit integer overflows every float
# it meets (a record's mean, a finiteness check).
JSON_MAX_DIGITS = 50
# Opened without following a link (it may lead to a private file) and without blocking (a FIFO would, for ever).
_PLAIN_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
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


def open_plain_file(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading if it is a regular file itself: a symbolic link (which may lead to a private
    file), a FIFO (which blocks) or a device (/dev/zero never ends) is refused. For files that may be anyone's."""
    try:
        fd = os.open(path, _PLAIN_OPEN)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a link
            raise ArtifactError(f"{path} is a symbolic link: only a plain file is read") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError(f"{path} is not a regular file (a FIFO, a device or a folder): only a plain file is read")
    return os.fdopen(fd, "rb")


def read_plain_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a plain file (`open_plain_file`) of at most `limit` bytes; a larger one is refused."""
    with open_plain_file(path) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ArtifactError(f"{path} holds more than {limit} bytes, more than such a file ever holds")
    return data


def load_json(text: str | bytes) -> Any:
    """`json.loads` for text from a file that may be anyone's: a number of more than JSON_MAX_DIGITS digits, or an
    object naming a key twice (which reader's value would count?), is a ValueError saying so."""
    return json.loads(text, parse_int=_bounded(int), parse_float=_bounded(float), object_pairs_hook=unique_keys)


def _bounded(parse: Callable[[str], int | float]) -> Callable[[str], int | float]:
    """`parse`, for a number of at most JSON_MAX_DIGITS digits."""

    def parse_number(text: str) -> int | float:
        digits = sum(c.isdigit() for c in text)
        if digits > JSON_MAX_DIGITS:
            raise ValueError(f"a number of {digits} digits (at most {JSON_MAX_DIGITS} are read)")
        return parse(text)

    return parse_number


class RepeatedKeyError(ValueError):
    """A JSON object naming a key twice (`json.loads` would keep the last one, silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"an object names the key {short_repr(key)} twice")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`' object_pairs_hook refusing a key named twice (`RepeatedKeyError`)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise RepeatedKeyError(key)
        found[key] = value
    return found


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
        params = load_json(read_header(path).get("params", "{}"))
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
            return header_of(handle, source)
    except OSError as exc:
        raise ArtifactError(f"{source}: not a readable safetensors file ({first_line(exc)})") from None


def header_of(handle: BinaryIO, source: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of the kvcompile artifact open in `handle` (at its start) and where its data starts."""
    try:
        size = int.from_bytes(handle.read(8), "little")
        if not 0 < size <= _LARGEST_HEADER:
            raise ValueError("no safetensors header")
        header = load_json(handle.read(size))
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
