"""A GGUF file's header read and bounded without torch, transformers or the gguf package's reader: its magic, version, counts,
string and array lengths, tensor shapes and the data they promise, each checked against the file's size before it is
believed. A file is taken as GGUF by its magic bytes, not its name. What transformers would read next (a crafted
count, a truncated tensor) is refused here in one line, in a fraction of a second."""

from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path
from typing import BinaryIO

from ..errors import KVRuntimeError, printable

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits; no current writer makes it
MAX_METADATA = 65_536  # keys: a real model has about 40
MAX_TENSORS = 1_000_000
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_SCALAR_TEXT = 1 << 24  # a chat template is a few KiB; a key a few dozen bytes
DEFAULT_ALIGNMENT = 32
# value type -> struct format of a scalar (8: a string, 9: an array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# Arrays kept in the header's metadata only up to this many items (the vocabulary's strings are counted, not kept).
KEPT_ARRAY_ITEMS = 64


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    version: int
    tensor_count: int
    metadata: dict[str, object]  # scalars and short arrays; a longer array is its length
    data_bytes: int  # the bytes its tensors promise, from their shapes and types

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def arch_value(self, key: str) -> object:
        """`<architecture>.<key>` (llama.cpp's per-architecture keys: block_count, context_length, ...)."""
        return self.metadata.get(f"{self.architecture}.{key}")


def is_gguf(path: Path) -> bool:
    """Whether `path` is a regular file that starts with GGUF's magic (its name says nothing)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class _Reader:
    """Reads a GGUF's header, every length checked against what is left of the file before it is read."""

    def __init__(self, handle: BinaryIO, size: int, name: str) -> None:
        self.handle, self.size, self.name = handle, size, name

    def refuse(self, what: str) -> KVRuntimeError:
        return KVRuntimeError(f"GGUF file {self.name} is not a readable model: {what}")

    def take(self, count: int) -> bytes:
        if count > self.size - self.handle.tell():
            raise self.refuse(f"it ends inside its header (at byte {self.size:,}): truncated or not a GGUF")
        return self.handle.read(count)

    def scalar(self, fmt: str) -> object:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int = MAX_SCALAR_TEXT) -> str:
        length = self.scalar("Q")
        if length > limit:
            raise self.refuse(f"a string of {length:,} bytes (at most {limit:,})")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise self.refuse(f"a metadata value of unknown type {kind}")
        item_kind, count = self.scalar("I"), self.scalar("Q")
        least = 8 if item_kind == STRING else struct.calcsize(SCALARS.get(item_kind, "B"))
        if item_kind == ARRAY or count * least > self.size - self.handle.tell():
            raise self.refuse(f"an array of {count:,} items past the end of the file")
        if item_kind in SCALARS and count > KEPT_ARRAY_ITEMS:  # skipped whole: a vocabulary's scores, say
            self.take(count * least)
            return count
        items = [self.value(item_kind) for _ in range(count)]
        return items if count <= KEPT_ARRAY_ITEMS else count


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF at `path`, refused in one line where it is not one a loader can read whole: no magic,
    another version, counts past bounds, a string, array or tensor past the end of the file."""
    name = printable(str(path))
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise KVRuntimeError(f"GGUF file {name} cannot be read: {exc.strerror}") from None
    with handle:
        size = Path(path).stat().st_size
        reader = _Reader(handle, size, name)
        if reader.take(len(MAGIC)) != MAGIC:
            raise reader.refuse("it does not start with GGUF's magic bytes")
        version = reader.scalar("I")
        if version not in VERSIONS:
            raise reader.refuse(f"GGUF version {version} (kvruntime reads {' and '.join(map(str, VERSIONS))})")
        tensor_count, metadata_count = reader.scalar("Q"), reader.scalar("Q")
        if tensor_count > MAX_TENSORS or metadata_count > MAX_METADATA:
            raise reader.refuse(f"{tensor_count:,} tensors and {metadata_count:,} metadata keys declared")
        metadata: dict[str, object] = {}
        for _ in range(metadata_count):
            key = reader.string(limit=1 << 16)
            if key in metadata:
                raise reader.refuse(f"the metadata key {printable(key)!r} appears twice")
            metadata[key] = reader.value(reader.scalar("I"))
        # Imported once the file is known to be a GGUF (about 0.15 s, numpy's): not for a file that is none.
        from gguf.constants import GGML_QUANT_SIZES  # ggml type -> (elements per block, bytes per block)

        blocks = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
        data_bytes = 0
        for _ in range(tensor_count):
            tensor = reader.string(limit=1 << 16)
            dims = reader.scalar("I")
            if dims > MAX_DIMS:
                raise reader.refuse(f"tensor {printable(tensor)!r} has {dims} dimensions")
            shape = [reader.scalar("Q") for _ in range(dims)]
            kind, offset = reader.scalar("I"), reader.scalar("Q")
            if kind not in blocks:
                raise reader.refuse(f"tensor {printable(tensor)!r} is of unknown ggml type {kind}")
            per_block, block_bytes = blocks[kind]
            elements = math.prod(shape)
            end = offset + -(-elements // per_block) * block_bytes
            if end > size:
                raise reader.refuse(f"tensor {printable(tensor)!r} lies past the end of the file")
            data_bytes = max(data_bytes, end)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1:
            raise reader.refuse(f"general.alignment is {printable(repr(alignment))}")
        data_start = -(-handle.tell() // alignment) * alignment
        if data_start + data_bytes > size:
            raise reader.refuse(
                f"its tensors need {data_start + data_bytes:,} bytes and the file has {size:,}: truncated"
            )
    return GGUFHeader(version, tensor_count, metadata, data_bytes)
