"""The `kvcompile` command line: every command registered on one `app`, in the order of its help. Options become
settings, then a recipe (`kvcompile/recipe.py`) or the runtime runs; nothing heavy is imported before the options are
checked, so that bad input is refused in one line before torch loads.

`commands.py`: the application, `generate` and the compile commands (`generation.py`: generate's inputs and its
resolved request); `evaluation.py`: `eval` and `tune`; `artifacts.py`: `merge`, `info`, `bundle`, `reproduce` and
`export-kvzap`."""

from __future__ import annotations

import importlib

from kvcompile.cli.commands import app, main

# Each module registers its commands on `app` as it loads: this order is the help's.
for _module in ("kvcompile.cli.evaluation", "kvcompile.cli.artifacts"):
    importlib.import_module(_module)

from kvcompile.cli.artifacts import compile_commands  # noqa: E402

__all__ = ["app", "compile_commands", "main"]
