"""Names a package exports from its modules, imported on first use (PEP 562): a package's `__init__` stays
torch-free, so that the torch-free parts under it (the method registrations, request checks) load without torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose public names are the keys of `exports` (name -> the
    submodule, relative to the package, that defines it)."""

    def getattr_(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{exports[name]}")
        return getattr(module, name)

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_
