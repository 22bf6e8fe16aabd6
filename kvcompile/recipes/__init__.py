"""Every compile recipe, by the artifact kind it writes: one package per method (`compresskv`, `compilerkv`,
`kvcompose`) and the runtime's tuned defaults. `kvcompile merge` finishes and draws partial statistics with these;
a new recipe is registered here."""

from __future__ import annotations

from kvcompile.recipe import Recipe
from kvcompile.recipes.compilerkv.tables import TablesRecipe
from kvcompile.recipes.compresskv.budgets import BudgetsRecipe
from kvcompile.recipes.compresskv.heads import HeadsRecipe
from kvcompile.recipes.distilled.distill import DistillRecipe
from kvcompile.recipes.kvcompose.attention_stats import StatsRecipe
from kvcompile.recipes.tuned_defaults.tuning import TuneRecipe

RECIPES: dict[str, type[Recipe]] = {
    recipe.kind: recipe for recipe in (HeadsRecipe, BudgetsRecipe, TablesRecipe, StatsRecipe, DistillRecipe, TuneRecipe)
}
