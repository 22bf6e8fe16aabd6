"""A compile run on a tiny model in its own process, for tests/test_kill_and_resume.py to kill -9:
`python kill_worker.py <stats|tables> <folder> [--resume]` writes <folder>/<recipe>.safetensors when it finishes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from distributed_worker import CORPUS, TABLES, CharTokenizer, tiny_model

from kvcompile.calibration.job import CompileJob
from kvcompile.recipes.compilerkv.tables import compile_tables
from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvruntime.artifacts.artifact import Artifact, save_artifact

STATS = StatsSettings(ratios=(0.3, 0.6), prompts=150, prompt_tokens=256)


# Each forward of a run to be killed takes at least this long: however fast the machine, or however slow the test
# watching it (a loaded machine), the run cannot finish between a checkpoint and the kill that follows it.
STALL_SECONDS = 0.005


def compile_recipe(recipe: str, folder: Path, resume: bool, stall: bool = False) -> Artifact:
    torch.set_num_threads(1)
    out = folder / f"{recipe}.safetensors"
    model = tiny_model("llama")
    if stall:
        model.register_forward_pre_hook(lambda *_: time.sleep(STALL_SECONDS))
    if recipe == "stats":
        return compile_attention_stats(
            CompileJob(model, CharTokenizer(), out, resume=resume, checkpoint_every=1), CORPUS, STATS
        )
    return compile_tables(CompileJob(model, CharTokenizer(), out, resume=resume), CORPUS, TABLES)[0]


if __name__ == "__main__":
    recipe, folder = sys.argv[1], Path(sys.argv[2])
    artifact = compile_recipe(recipe, folder, "--resume" in sys.argv, stall=True)
    save_artifact(artifact, folder / f"{recipe}.safetensors")
