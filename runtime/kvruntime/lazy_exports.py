"""Names a package exports from its modules, imported on first use (PEP 562): a package's `__init__` stays
torch-free, so that the torch-free parts under it (the method registrations, request checks) load without torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose public names are the keys of `exports` (name -> the
    submodule, relative to the package, that defines it)."""

    def getattr_(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        vars(sys.modules[package])[name] = value  # later look-ups find it without this function
        return value

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_
