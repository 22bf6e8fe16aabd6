"""`kvcompile stats`: KVCompose's attention statistics, measured once over a calibration corpus.

Each calibration prompt is prefilled, then scored the paper's way: task-agnostic (the prompt fed again after
itself) or task-aware (each prompt of a task set fed after it, one at a time; Agg_task = max over all their
tokens). From the scores S [layers, KV heads, tokens] of each prompt come exactly what the runtime's dynamic mode
computes on its own prompt (the layer allocation for every compiled ratio, and the per-head allocation of the
unstructured variant), averaged over prompts as shares of the prompt, plus the composite-token curves and every
(layer, KV head)'s score quantiles at fixed rank quantiles.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import DynamicCache

from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.partial_statistics import StatisticsRun, accumulate, finish_or_partial
from kvcompile.calibration.provenance import provenance
from kvcompile.recipes.kvcompose.settings import WINDOW, StatsSettings, TaskSet
from kvruntime import Artifact, model_fingerprint
from kvruntime.math.composite_tokens import (
    composite_curve,
    kv_head_scores,
    prompt_allocation,
    rank_quantile_values,
    sorted_head_scores,
)
from kvruntime.plumbing.cache_ops import cache_argument
from kvruntime.plumbing.second_pass import task_attention_maxima
from kvruntime.requests.request import kept_per_head

# Rank quantiles of the stored curves: dense at the top, where the scores fall fastest.
RANK_QUANTILES = torch.cat([torch.zeros(1), torch.logspace(-3, 0, 96)])


def prompt_scores(model: nn.Module, context_ids: torch.Tensor, tasks: list[torch.Tensor] | None) -> torch.Tensor:
    """S [layers, KV heads, tokens] of one prompt (eq. 14-16); `tasks` None is the task-agnostic mode."""
    length = context_ids.shape[1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.base_model(input_ids=context_ids, **cache_argument(model, cache), use_cache=True)
    maxima = None
    for task_ids in tasks or [context_ids]:
        layers = task_attention_maxima(model, cache, task_ids, length)
        maxima = layers if maxima is None else [torch.maximum(a, b) for a, b in zip(maxima, layers)]
    num_kv_heads = cache.layers[0].keys.shape[1]
    return torch.stack([kv_head_scores(task_max, num_kv_heads)[0] for task_max in maxima])


def prompt_allocations(scores: torch.Tensor, ratios: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic mode's allocations on one prompt, as shares of it, for every ratio: layers [R, L] and
    (layer, KV head) [R, L, Hkv] (the unstructured variant)."""
    length = scores.shape[-1]
    layers, heads = [], []
    for ratio in ratios:
        keep = kept_per_head(length, WINDOW, ratio=ratio)
        layers.append(prompt_allocation(scores, keep, per_head=False).double() / length)
        heads.append(prompt_allocation(scores, keep, per_head=True).double() / length)
    return torch.stack(layers), torch.stack(heads)


def compile_attention_stats(
    job: CompileJob, corpus: Corpus, settings: StatsSettings, task_set: TaskSet | None = None
) -> Artifact:
    """The kvcompose_stats artifact (or this shard's partial statistics)."""
    model, tokenizer = job.model, job.tokenizer
    settings.check()
    calibration = calibration_prompts(corpus, tokenizer, settings.prompts, settings.prompt_tokens, settings.seed)
    tasks = None
    if task_set is not None:
        tasks = [
            torch.tensor([tokenizer(p, add_special_tokens=False).input_ids], device=model.device)
            for p in task_set.prompts
        ]
    run = StatisticsRun(
        kind="kvcompose_stats",
        model=model_fingerprint(model),
        settings={
            "corpus_sha256": corpus.sha256,
            "task_set_sha256": task_set.sha256 if task_set else None,
            "task_prompts": len(task_set.prompts) if task_set else 0,
            **dataclasses.asdict(settings),
            "window": WINDOW,
        },
        items=len(calibration),
        provenance=provenance(corpus, settings.seed, task_set=task_set.name if task_set else None),
    )
    layers, heads, ratios = run.model.num_layers, run.model.num_kv_heads, len(settings.ratios)
    sums = {
        "layer_fractions": torch.zeros(ratios, layers, dtype=torch.float64),
        "layer_fraction_squares": torch.zeros(ratios, layers, dtype=torch.float64),
        "head_fractions": torch.zeros(ratios, layers, heads, dtype=torch.float64),
        "composite_curves": torch.zeros(layers, len(RANK_QUANTILES), dtype=torch.float64),
        "head_score_quantiles": torch.zeros(layers, heads, len(RANK_QUANTILES), dtype=torch.float64),
    }

    def add_prompt(index: int, sums: dict[str, torch.Tensor]) -> None:
        scores = prompt_scores(model, calibration[index][1].to(model.device), tasks).double().cpu()
        layer_shares, head_shares = prompt_allocations(scores, settings.ratios)
        sums["layer_fractions"] += layer_shares
        sums["layer_fraction_squares"] += layer_shares.square()
        sums["head_fractions"] += head_shares
        sums["composite_curves"] += rank_quantile_values(composite_curve(scores), RANK_QUANTILES)
        sums["head_score_quantiles"] += rank_quantile_values(sorted_head_scores(scores), RANK_QUANTILES)

    label = f"attention stats ({'task-aware' if task_set else 'task-agnostic'})"
    sums = accumulate(run, sums, add_prompt, job, label, "prompt")
    return finish_or_partial(run, sums, [job.shard.describe()], finish_attention_stats)


def finish_attention_stats(sums: dict[str, torch.Tensor], run: StatisticsRun) -> Artifact:
    """Means over the prompts, and the spread of the layer shares."""
    mean = {name: total / run.items for name, total in sums.items() if total.is_floating_point()}
    spread = (mean["layer_fraction_squares"] - mean["layer_fractions"].square()).clamp_min(0).sqrt()
    settings = run.settings
    return Artifact(
        kind="kvcompose_stats",
        tensors={
            "ratios": torch.tensor(settings["ratios"], dtype=torch.float32),
            "layer_fractions": mean["layer_fractions"].float(),
            "layer_fraction_std": spread.float(),
            "head_fractions": mean["head_fractions"].float(),
            "rank_quantiles": RANK_QUANTILES.clone(),
            "composite_curves": mean["composite_curves"].float(),
            "head_score_quantiles": mean["head_score_quantiles"].float(),
        },
        model=run.model,
        provenance=run.provenance,
        params={
            "task_mode": "task-aware" if settings["task_set_sha256"] else "task-agnostic",
            "task_prompts": settings["task_prompts"],
            "prompts": settings["prompts"],
            "prompt_tokens": settings["prompt_tokens"],
            "window": WINDOW,
            "aggregation": {"task": "max", "group": "mean", "head": "mean", "consistency": "plus mean over KV heads"},
            "first_layer": "composite curve lifted to the largest of any layer (reference implementation)",
            "fractions": "mean over prompts of tokens kept / prompt tokens",
        },
    )
