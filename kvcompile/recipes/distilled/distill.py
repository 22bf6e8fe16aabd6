"""`kvcompile distill`: a one-pass student of what a second pass over the context finds.

Oracle (offline, per calibration prompt): the prompt is prefilled, then fed again after itself, and each context
token is scored per (layer, KV head) by what the copy gives it (`kvruntime.methods.distilled.oracle`: attention as
KVCompose's task-agnostic pass for `reconstruction`, KVzap's output-weighted attention for `kvzip_plus`; `repeat`
and `kvzip_plus` put "repeat the text" before the copy, and the artifact records those token ids so that the
runtime can replay the oracle, `distilled:scores=oracle`).
Student: per layer, a ridge regression from each token's features at prefill (the attention input, its position,
its likeness to the tokens before it) to the log of those scores, fitted from sufficient statistics (X^T X, X^T Y
summed over tokens), which add up exactly over shards, ranks and resumed runs. Every 4th calibration prompt is held
out: its sums choose each layer's ridge strength (validation error computed from the sums alone), then the weights
are fitted on all prompts. Beside them, per ratio of `SHARE_RATIOS`, the share of the kept cache each layer takes in
the teacher's dynamic allocation of each prompt (the runtime's rule, its default window and floor), averaged over the
prompts whose text repeats (`shares_from`) or all: the layer shares of `allocation="compiled"`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache

from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.partial_statistics import StatisticsRun, accumulate, finish_or_partial
from kvcompile.calibration.provenance import provenance
from kvcompile.recipes.distilled.lookahead import lookahead_contexts, train_lookahead_queries
from kvcompile.recipes.distilled.settings import HELD_OUT_EVERY, DistillSettings
from kvruntime import Artifact, KVRuntimeError, model_fingerprint
from kvruntime.math.repetition import repeated_ngram_fraction, repeats
from kvruntime.math.selection import protect_sinks, protect_window
from kvruntime.methods.distilled import (
    PREFIXED,
    feature_count,
    oracle_scores,
    oracle_targets,
    second_pass_target,
    student_features,
    token_features,
)
from kvruntime.methods.distilled.method import dynamic_layer_counts
from kvruntime.methods.distilled.spec import SPEC
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.cache_ops import cache_argument
from kvruntime.plumbing.second_pass import task_attention_maxima
from kvruntime.requests.request import kept_per_head

REPEAT_INSTRUCTION = "\n\nRepeat the text above, word for word:\n\n"
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strengths tried, relative to the mean diagonal of X^T X
SHARE_RATIOS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 to 0.95: the compiled allocation's grid


def prefill_features_and_targets(
    model: nn.Module, tokenizer: object, context_ids: torch.Tensor, oracle: str
) -> tuple[DynamicCache, list[torch.Tensor], torch.Tensor]:
    """Each layer's token features [N, F] (float64) from the prefill, and the oracle's log-scores [L, Hkv, N] from
    its second pass (the context again, after `oracle_prefix`); on the CPU, whatever the model's device."""
    prefix = torch.tensor([oracle_prefix(tokenizer, oracle)], dtype=context_ids.dtype)
    context_ids = context_ids.to(model.device)
    task_ids = torch.cat([prefix.to(model.device), context_ids], dim=1)
    length = context_ids.shape[1]
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        inputs[module.layer_idx] = token_features(hidden_states)[0].cpu().double()

    handles = [m.register_forward_hook(keep_input, with_kwargs=True) for m in model_layout(model).cut_modules]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model.base_model(input_ids=context_ids, **cache_argument(model, cache), use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    maxima = task_attention_maxima(model, cache, task_ids, length, target=second_pass_target(oracle))
    num_kv_heads = cache.layers[0].keys.shape[1]
    scores = torch.stack([oracle_scores(task_max, num_kv_heads, oracle)[0] for task_max in maxima])
    return cache, [inputs[layer] for layer in sorted(inputs)], oracle_targets(scores).cpu()


def prompt_features_and_targets(
    model: nn.Module, tokenizer: object, context_ids: torch.Tensor, oracle: str
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`prefill_features_and_targets` without the prefill's cache."""
    return prefill_features_and_targets(model, tokenizer, context_ids, oracle)[1:]


def teacher_layer_shares(log_scores: torch.Tensor, window: int, sinks: int, floor: float) -> torch.Tensor:
    """[len(SHARE_RATIOS), L]: each layer's share of the kept cache in the teacher's dynamic allocation of one prompt
    (its log-scores [L, Hkv, N], the last `window` and first `sinks` tokens protected, each layer at least `floor`
    of the average), at each ratio of the grid."""
    length = log_scores.shape[-1]
    protected = protect_sinks(protect_window(log_scores.float(), min(window, length)), sinks)
    rows = []
    for ratio in SHARE_RATIOS:
        counts = dynamic_layer_counts(protected, kept_per_head(length, window, ratio=ratio), floor).double()
        rows.append(counts / counts.sum())
    return torch.stack(rows)


def oracle_prefix(tokenizer: object, oracle: str) -> list[int]:
    """The token ids the second pass feeds before the copy of the context: the repeat instruction, or nothing."""
    if oracle not in PREFIXED:
        return []
    return list(tokenizer(REPEAT_INSTRUCTION, add_special_tokens=False).input_ids)


def compile_distilled_scorer(job: CompileJob, corpus: Corpus, settings: DistillSettings) -> Artifact:
    """The distilled_scorer artifact (or this shard's partial statistics)."""
    settings.check()
    model, tokenizer = job.model, job.tokenizer
    calibration = calibration_prompts(corpus, tokenizer, settings.prompts, settings.prompt_tokens, settings.seed)
    fingerprint = model_fingerprint(model)
    run = StatisticsRun(
        kind="distilled_scorer",
        model=fingerprint,
        settings={
            "corpus_sha256": corpus.sha256,
            **dataclasses.asdict(settings),
            "alphas": list(ALPHAS),
            "task_prefix": oracle_prefix(tokenizer, settings.oracle),
        },
        items=len(calibration),
        provenance=provenance(corpus, settings.seed),
    )
    layers, heads = fingerprint.num_layers, fingerprint.num_kv_heads
    features = feature_count(model.config.hidden_size)
    sums = {}
    for part in ("fit", "held_out"):
        sums[f"xtx_{part}"] = torch.zeros(layers, features, features, dtype=torch.float64)
        sums[f"xty_{part}"] = torch.zeros(layers, features, heads, dtype=torch.float64)
    sums["yty_held_out"] = torch.zeros(layers, heads, dtype=torch.float64)
    sums["ysum_held_out"] = torch.zeros(layers, heads, dtype=torch.float64)
    sums["tokens_held_out"] = torch.zeros(1, dtype=torch.float64)
    for group in ("all", "repeating"):
        sums[f"layer_shares_{group}"] = torch.zeros(len(SHARE_RATIOS), layers, dtype=torch.float64)
    sums["repeating_prompts"] = torch.zeros(1, dtype=torch.float64)
    window, floor = SPEC.window, float(SPEC.options["floor"].default)  # the runtime's defaults
    sinks = int(SPEC.options["sinks"].default)

    def add_prompt(index: int, sums: dict[str, torch.Tensor]) -> None:
        _, ids = calibration[index]
        inputs, targets = prompt_features_and_targets(model, tokenizer, ids, settings.oracle)
        part = "held_out" if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "fit"
        shares = teacher_layer_shares(targets, window, sinks, floor)
        sums["layer_shares_all"] += shares
        if repeats(repeated_ngram_fraction(ids[0])):
            sums["layer_shares_repeating"] += shares
            sums["repeating_prompts"] += 1
        for layer, x in enumerate(inputs):
            y = targets[layer].T  # [N, Hkv]
            sums[f"xtx_{part}"][layer] += x.T @ x
            sums[f"xty_{part}"][layer] += x.T @ y
            if part == "held_out":
                sums["yty_held_out"][layer] += (y * y).sum(dim=0)
                sums["ysum_held_out"][layer] += y.sum(dim=0)
        if part == "held_out":
            sums["tokens_held_out"] += ids.shape[1]

    sums = accumulate(run, sums, add_prompt, job, f"distill ({settings.oracle})", "prompt")
    artifact = finish_or_partial(run, sums, [job.shard.describe()], finish_distilled_scorer)
    if artifact.kind != "distilled_scorer" or not settings.lookahead_queries:
        return artifact
    return with_lookahead_queries(artifact, job, corpus, settings)


def oracle_prefill(
    model: nn.Module, tokenizer: object, oracle: str
) -> Callable[[torch.Tensor], tuple[DynamicCache, torch.Tensor]]:
    """What `lookahead_contexts` prefills a context with: ids -> its plain cache and the oracle's log-scores."""

    def prefill_and_oracle(ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
        cache, _, targets = prefill_features_and_targets(model, tokenizer, ids, oracle)
        return cache, targets

    return prefill_and_oracle


def with_lookahead_queries(artifact: Artifact, job: CompileJob, corpus: Corpus, settings: DistillSettings) -> Artifact:
    """The scorer with its lookahead queries, trained on contexts of the same corpus (another seed's) to match the
    same oracle (`lookahead.py`)."""
    tokens = min(settings.lookahead_tokens, settings.prompt_tokens)  # a context fits where the prompts did
    contexts = lookahead_contexts(
        job.model,
        job.tokenizer,
        corpus,
        oracle_prefill(job.model, job.tokenizer, settings.oracle),
        count=settings.lookahead_prompts + settings.lookahead_held_out,
        tokens=tokens,
        seed=settings.seed + 1,
    )
    queries, losses = train_lookahead_queries(
        job.model,
        contexts[: settings.lookahead_prompts],
        queries=settings.lookahead_queries,
        steps=settings.lookahead_steps,
        seed=settings.seed + 1,
        held_out=contexts[settings.lookahead_prompts :],
    )
    params = {
        **artifact.params,
        "lookahead_on": settings.lookahead_on,
        "lookahead": {
            "queries": settings.lookahead_queries,
            "steps": settings.lookahead_steps,
            "prompts": settings.lookahead_prompts,
            "held_out": settings.lookahead_held_out,
            "tokens": tokens,
            "loss": "KL from the oracle's scores to the queries' mean attention, per layer cut and KV head",
            **{name: round(value, 4) for name, value in losses.items()},
        },
    }
    return dataclasses.replace(artifact, tensors={**artifact.tensors, "lookahead_queries": queries}, params=params)


def averaged_layer_shares(sums: dict[str, torch.Tensor], prompts: int, shares_from: str) -> tuple[torch.Tensor, str]:
    """The teacher's layer shares averaged over the prompts `shares_from` names ([ratios, layers], each row summing
    to 1), and which prompts those were; all prompts' when none repeats."""
    repeating = int(sums["repeating_prompts"]) if shares_from == "repeating" else 0
    if repeating:
        source = f"the {repeating} of {prompts} calibration prompts whose text repeats"
        return sums["layer_shares_repeating"] / repeating, source
    source = f"all {prompts} calibration prompts" + (" (none repeats)" if shares_from == "repeating" else "")
    return sums["layer_shares_all"] / prompts, source


def ridge(xtx: torch.Tensor, xty: torch.Tensor, alpha: float) -> torch.Tensor:
    """argmin_W |Y - X W|^2 + lam |W|^2 with lam = alpha * mean(diag(X^T X)): [F, H]."""
    lam = alpha * float(xtx.diagonal().mean())
    return torch.linalg.solve(xtx + lam * torch.eye(xtx.shape[0], dtype=xtx.dtype), xty)


def held_out_error(w: torch.Tensor, xtx: torch.Tensor, xty: torch.Tensor, yty: torch.Tensor) -> torch.Tensor:
    """Sum over held-out tokens of the squared error per KV head, from the held-out sums alone: [H]."""
    return yty - 2 * (w * xty).sum(dim=0) + (w * (xtx @ w)).sum(dim=0)


def finish_distilled_scorer(sums: dict[str, torch.Tensor], run: StatisticsRun) -> Artifact:
    """Per layer, the ridge strength with the least held-out error, then the weights fitted on every prompt (on the
    student's features only: the sums of the others are left out, their weights stay 0)."""
    tokens = float(sums["tokens_held_out"])
    if tokens == 0:
        raise KVRuntimeError("no held-out prompt: give at least 4 prompts")
    student = run.settings.get("student", "all")
    shares, share_prompts = averaged_layer_shares(sums, run.items, run.settings.get("shares_from", "all"))
    layers, features, heads = sums["xty_fit"].shape
    hidden_size = features - feature_count(0)  # the attention input's width
    read = student_features(hidden_size, student)
    r2 = torch.zeros(layers, len(ALPHAS), dtype=torch.float64)
    weights, chosen = torch.zeros(layers, features, heads, dtype=torch.float64), []
    for layer in range(layers):
        xtx_fit, xty_fit = sums["xtx_fit"][layer][read][:, read], sums["xty_fit"][layer][read]
        xtx, xty = sums["xtx_held_out"][layer][read][:, read], sums["xty_held_out"][layer][read]
        variance = sums["yty_held_out"][layer] - sums["ysum_held_out"][layer] ** 2 / tokens  # per head, x tokens
        for a, alpha in enumerate(ALPHAS):
            w = ridge(xtx_fit, xty_fit, alpha)
            error = held_out_error(w, xtx, xty, sums["yty_held_out"][layer])
            r2[layer, a] = 1 - (error / variance).mean()
        best = int(r2[layer].argmax())
        chosen.append(ALPHAS[best])
        weights[layer, read] = ridge(xtx_fit + xtx, xty_fit + xty, ALPHAS[best])
    described = {
        "all": "attention input (after the input norm), bias, log1p(position), first token, likeness to the "
        "earlier tokens",
        "hidden": "attention input (after the input norm) and bias (KVzap's student; the others weigh 0)",
    }
    return Artifact(
        kind="distilled_scorer",
        tensors={
            "weights": weights.float(),
            "held_out_r2": r2.float(),  # [layers, alphas]: 1 - held-out error / held-out variance, per alpha
            "alpha": torch.tensor(chosen, dtype=torch.float32),
            "layer_shares": shares.float(),  # [ratios, layers], each row sums to 1
            "share_ratios": torch.tensor(SHARE_RATIOS, dtype=torch.float32),
        },
        model=run.model,
        provenance=run.provenance,
        params={
            "oracle": run.settings["oracle"],
            "task_prefix": run.settings.get("task_prefix", []),  # token ids fed before the copy (runtime replay)
            "student": student,
            "prompts": run.items,
            "prompt_tokens": run.settings["prompt_tokens"],
            "held_out_every": HELD_OUT_EVERY,
            "alphas": list(ALPHAS),
            "features": described[student],
            "target": "log of the oracle's score (clamped at 1e-6)",
            "share_prompts": share_prompts,  # the calibration prompts the layer shares are averaged over
            "share_floor": SPEC.options["floor"].default,  # the runtime re-floors the shares from it
            "layer_shares": f"the teacher's dynamic allocation of the calibration prompts (window {SPEC.window}, "
            f"sinks {SPEC.options['sinks'].default}, floor {SPEC.options['floor'].default}), averaged per ratio",
        },
    )
