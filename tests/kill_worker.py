"""A compile run on a tiny model in its own process, for tests/test_kill_and_resume.py to kill -9:
`python kill_worker.py <stats|tables> <folder> [--resume]` writes <folder>/<recipe>.safetensors when it finishes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from distributed_worker import CORPUS, TABLES, CharTokenizer, tiny_model

from kvcompile.calibration.job import CompileJob
from kvcompile.recipes.compilerkv.tables import compile_tables
from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvruntime.artifact import Artifact, save_artifact

STATS = StatsSettings(ratios=(0.3, 0.6), prompts=150, prompt_tokens=256)


def compile_recipe(recipe: str, folder: Path, resume: bool) -> Artifact:
    torch.set_num_threads(1)
    out = folder / f"{recipe}.safetensors"
    model = tiny_model("llama")
    if recipe == "stats":
        return compile_attention_stats(
            CompileJob(model, CharTokenizer(), out, resume=resume, checkpoint_every=1), CORPUS, STATS
        )
    return compile_tables(CompileJob(model, CharTokenizer(), out, resume=resume), CORPUS, TABLES)[0]


if __name__ == "__main__":
    recipe, folder = sys.argv[1], Path(sys.argv[2])
    save_artifact(compile_recipe(recipe, folder, "--resume" in sys.argv), folder / f"{recipe}.safetensors")
