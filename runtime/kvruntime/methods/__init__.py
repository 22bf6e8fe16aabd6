"""Compression methods by name."""

from __future__ import annotations

from ..errors import KVRuntimeError
from .base import Method
from .kvcompress import KVCompress
from .snapkv import SnapKV

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (SnapKV, KVCompress)}


def get_method(name: str | Method) -> Method:
    """A method instance from its name (an instance is returned as is)."""
    if isinstance(name, Method):
        return name
    try:
        return METHODS[name]()
    except KeyError:
        raise KVRuntimeError(f"unknown method {name!r} (available: {', '.join(sorted(METHODS))})") from None


__all__ = ["METHODS", "KVCompress", "Method", "SnapKV", "get_method"]
