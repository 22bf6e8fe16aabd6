"""Every compile recipe, by the artifact kind it writes: one package per method (`compresskv`, `compilerkv`,
`kvcompose`, `distilled`) and the runtime's tuned defaults, each with a `recipe.py` whose `Recipe` subclasses
(those that set `kind`) are found here, so that a new recipe registers itself in its own package. `kvcompile merge`
finishes and draws partial statistics with these. Torch-free: each package's `recipe.py` checks its settings
before the work is imported."""

from __future__ import annotations

import importlib
from pathlib import Path

from kvcompile.recipe import Recipe


def discover(folder: Path, package: str) -> dict[str, type[Recipe]]:
    """The recipes defined in `package.<name>.recipe` for every recipe package under `folder`, by kind."""
    recipes: dict[str, type[Recipe]] = {}
    for entry in sorted(folder.iterdir()):
        if not (entry / "recipe.py").is_file():
            continue
        module = importlib.import_module(f"{package}.{entry.name}.recipe")
        for value in vars(module).values():
            defined_here = isinstance(value, type) and value.__module__ == module.__name__
            if defined_here and issubclass(value, Recipe) and isinstance(getattr(value, "kind", None), str):
                recipes[value.kind] = value
    return recipes


RECIPES: dict[str, type[Recipe]] = discover(Path(__file__).parent, __name__)
