"""The `kvcompile` command line: every command registered on one `app`, in the order of its help. Options become
settings, then a recipe (`kvcompile/recipe.py`) or the runtime runs; nothing heavy is imported before the options are
checked, so that bad input is refused in one line before torch loads.

`commands.py`: the application, `generate` and the compile commands (`generation.py`: generate's options, inputs and
resolved request); `compile_all.py`: `compile`, the compile commands some methods need, one after another; `evaluation.py`: `eval` and `tune`; `artifacts.py`: `merge`, `info`, `bundle`, `reproduce` and
`export-kvzap`. Each module registers its commands on `app` as it is imported: the imports' order is the help's."""

from __future__ import annotations

from kvcompile.cli.commands import app, main

# isort: split
import kvcompile.cli.compile_all  # noqa: F401  (compile: every artifact some methods need)

# isort: split
import kvcompile.cli.evaluation  # noqa: F401  (eval, tune)

# isort: split
from kvcompile.cli.artifacts import compile_commands

__all__ = ["app", "compile_commands", "main"]
