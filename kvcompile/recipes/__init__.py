"""Every compile recipe, by the artifact kind it writes: one package per method (`compresskv`, `compilerkv`,
`kvcompose`) and the runtime's tuned defaults. `kvcompile merge` finishes and draws partial statistics with these;
a new recipe is registered here. Torch-free: each package's `recipe.py` checks its settings before the work
is imported."""

from __future__ import annotations

from kvcompile.recipe import Recipe
from kvcompile.recipes.compilerkv.recipe import TablesRecipe
from kvcompile.recipes.compresskv.recipe import BudgetsRecipe, HeadsRecipe
from kvcompile.recipes.distilled.recipe import DistillRecipe
from kvcompile.recipes.kvcompose.recipe import StatsRecipe
from kvcompile.recipes.tuned_defaults.recipe import TuneRecipe

RECIPES: dict[str, type[Recipe]] = {
    recipe.kind: recipe for recipe in (HeadsRecipe, BudgetsRecipe, TablesRecipe, StatsRecipe, DistillRecipe, TuneRecipe)
}
