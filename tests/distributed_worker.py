"""One rank of a gloo process group on the CPU, running the compile recipes on a tiny model (tests/test_distributed.py
starts it with torch.multiprocessing)."""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import CharTokenizer, tiny_model

from kvcompile.calibration.corpus import Corpus
from kvcompile.calibration.distributed import Shard, process_group_shard
from kvcompile.calibration.job import CompileJob
from kvcompile.recipes.compilerkv.settings import CQLSettings, ExperienceDesign, TablesSettings
from kvcompile.recipes.compilerkv.tables import compile_tables
from kvcompile.recipes.compresskv.layer_errors import compile_layer_errors
from kvcompile.recipes.compresskv.settings import LayerErrorsSettings
from kvcompile.recipes.distilled.distill import compile_distilled_scorer
from kvcompile.recipes.distilled.settings import DistillSettings
from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvruntime.artifacts.artifact import Artifact, save_artifact
from kvruntime.artifacts.fingerprint import model_fingerprint
from kvruntime.errors import KVRuntimeError

CORPUS = Corpus("synthetic", tuple("".join(chr(97 + (i * 7 + j * j * 13) % 26) for j in range(9000)) for i in range(3)))
STATS = StatsSettings(ratios=(0.3, 0.6), prompts=5, prompt_tokens=96)
TABLES = TablesSettings(
    budgets=(80, 120),
    prompts=3,
    candidates=5,
    context_tokens=160,
    continuation=12,
    rounds=2,
    entropy_bins=3,
    perplexity_bins=2,
    design=ExperienceDesign(head_groups=2, head_actions=4, gate_layers=2, gate_actions=5),
    cql=CQLSettings(steps=40),
)
DISTILL = DistillSettings(
    prompts=4, prompt_tokens=96, lookahead_queries=2, lookahead_steps=4, lookahead_prompts=2, lookahead_tokens=64
)
RECIPES = ("stats", "budgets", "tables", "distilled")


def heads_artifact(model: torch.nn.Module) -> Artifact:
    scores = torch.rand(4, 4, generator=torch.Generator().manual_seed(3))
    return Artifact(kind="srh_heads", tensors={"srh_score": scores}, model=model_fingerprint(model), provenance={})


def compile_all(folder: Path, shard: Shard, stats: StatsSettings = STATS) -> None:
    """Every recipe into `folder` (artifacts written by the shard that writes results)."""
    torch.set_num_threads(1)
    model = tiny_model("llama")
    artifacts = {
        "stats": compile_attention_stats(
            CompileJob(model, CharTokenizer(), folder / "stats", shard=shard), CORPUS, stats
        ),
        "budgets": compile_layer_errors(
            CompileJob(model, CharTokenizer(), folder / "budgets", shard=shard),
            CORPUS,
            heads_artifact(model),
            LayerErrorsSettings(prompts=4, prompt_tokens=64, new_tokens=3, seed=0),
        ),
        "tables": compile_tables(CompileJob(model, CharTokenizer(), folder / "tables", shard=shard), CORPUS, TABLES)[0],
        "distilled": compile_distilled_scorer(
            CompileJob(model, CharTokenizer(), folder / "distilled", shard=shard), CORPUS, DISTILL
        ),
    }
    if shard.writes_results:
        for name, artifact in artifacts.items():
            save_artifact(artifact, folder / f"{name}.safetensors")


def rank_main(rank: int, world: int, folder: str, disagreeing_rank: int) -> None:
    """Join the group through a file store, compile everything (rank `disagreeing_rank` with another seed), and
    write any project error to error<rank>.txt."""
    # The rendezvous file lies beside the folder: gloo may remove it only after the ranks have exited, and the folder
    # must hold nothing but what the run wrote.
    dist.init_process_group("gloo", init_method=f"file://{folder}.store", rank=rank, world_size=world)
    try:
        stats = dataclasses.replace(STATS, seed=1) if rank == disagreeing_rank else STATS
        compile_all(Path(folder), process_group_shard(), stats)
    except KVRuntimeError as exc:
        Path(folder, f"error{rank}.txt").write_text(str(exc))
    except BaseException:
        Path(folder, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def tables_rank_main(rank: int, world: int, folder: str, stop_one_step_apart: bool) -> None:
    """Rank `rank` of a tables run. With `stop_one_step_apart`, the run stops as a kill -9 between the ranks' saves
    would leave it: after the first fit, rank 0 saves its checkpoint and dies, rank 1 dies before saving (its last
    checkpoint is the finished collection). Without it, the run resumes from the checkpoints and writes the tables."""
    import os

    from kvcompile.recipes.compilerkv import tables

    dist.init_process_group(
        "gloo", init_method=f"file://{folder}.store{int(stop_one_step_apart)}", rank=rank, world_size=world
    )
    real_save = tables.save_checkpoint

    def save_then_die(out, tensors, progress, settings, shard):
        first_fit_done = (progress["round"], progress["phase"], progress["unit"]) == (0, 1, 0)
        if first_fit_done and rank == 1:
            os._exit(0)
        real_save(out, tensors, progress, settings, shard)
        if first_fit_done:
            os._exit(0)

    if stop_one_step_apart:
        tables.save_checkpoint = save_then_die
    try:
        torch.set_num_threads(1)
        out = Path(folder) / "tables"
        artifact = tables.compile_tables(
            CompileJob(
                tiny_model("llama"), CharTokenizer(), out, resume=not stop_one_step_apart, shard=process_group_shard()
            ),
            CORPUS,
            TABLES,
        )[0]
        if rank == 0:
            save_artifact(artifact, Path(folder) / "tables.safetensors")
    except BaseException:
        Path(folder, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
