"""Collecting CompilerKV's bandit experience on calibration prompts.

Each prompt is prefilled once: its signals (alpha, rho, risks), its full cache and its continuation's NLL over the
full cache. A unit of work is one (prompt, budget): the current tables give the base selection, a few states are
probed with a sample of actions, and every probe's kept set is decoded over (`ContinuationScorer`). Probes whose
kept set equals the base's, or another probe's, share that rollout's NLL: exact, and most probes are such (within a
KV group only the largest head weight matters; at small budgets most thresholds admit more than the budget).
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch
from torch import nn
from transformers import DynamicCache

from kvcompile.recipes.compilerkv.bandit_experience import GATE_ACTIONS, HEAD_ACTIONS, Records
from kvcompile.recipes.compilerkv.continuation_nll import ContinuationScorer, PrefilledPrompt
from kvruntime import (
    CompilerKV,
    KVRuntimeError,
    PromptSignals,
    cache_argument,
    candidate_count,
    gated_count,
    layer_scores,
    layer_signals,
    prompt_signals,
    query_hooks,
    top_indices,
)

WINDOW = CompilerKV.window  # the runtime method's observation window: the rollouts see what it sees


@dataclasses.dataclass(frozen=True)
class ExperienceDesign:
    """How much is probed per (prompt, budget): (layer, KV group) pairs x weights for the head table (every query
    head of a probed group gets the same weights), layers x thresholds for the gate."""

    head_groups: int = 2  # (layer, KV group) pairs probed for the head table
    head_actions: int = 8  # weight settings tried on each
    gate_layers: int = 4  # layers probed for the gate table
    gate_actions: int = 7  # thresholds tried on each


@dataclasses.dataclass
class CalibrationPrompt:
    index: int
    signals: PromptSignals
    prefilled: PrefilledPrompt
    full_nll: float
    entropy_bin: int = 0
    perplexity_bin: int = 0


@torch.no_grad()
def prefill_prompt(model: nn.Module, ids: torch.Tensor, context: int, index: int, batch_size: int) -> CalibrationPrompt:
    """Prefill the first `context` tokens of `ids` [1, context + continuation] with the runtime's signal hooks."""
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def gather(module: nn.Module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, _: int) -> None:
        layers[module.layer_idx] = layer_signals(queries, keys, values, module.scaling)

    cache = DynamicCache(config=model.config)
    with query_hooks(model, gather, window=WINDOW):
        logits = model(ids[:, :context], **cache_argument(model, cache), use_cache=True, logits_to_keep=WINDOW).logits
    logprobs = logits[0].float().log_softmax(dim=-1)
    window_logprobs = logprobs[:-1].gather(-1, ids[0, context - WINDOW + 1 : context, None]).T  # [1, w - 1]
    continuation = ids[:, context:]
    prefilled = PrefilledPrompt(
        keys=[layer.keys for layer in cache.layers],
        values=[layer.values for layer in cache.layers],
        continuation=continuation,
        first_nll=float(-logprobs[-1, continuation[0, 0]]),
    )
    full = ContinuationScorer(model, prefilled, batch_size).base([torch.arange(context)] * len(cache.layers)).nll
    _finite(full, index)
    signals = prompt_signals([layers[i] for i in range(len(layers))], window_logprobs)
    return CalibrationPrompt(index=index, signals=signals, prefilled=prefilled, full_nll=full)


def _finite(nll: float, prompt: int) -> float:
    if not math.isfinite(nll):
        raise KVRuntimeError(
            f"calibration prompt {prompt}: the continuation NLL is {nll}: the model gives non-finite logits "
            "(check its weights and dtype); nothing was written"
        )
    return nll


def _kept(scores: torch.Tensor, count: int) -> torch.Tensor:
    return top_indices(scores[None, None], count)[0, 0]


def probed_states(
    kind: str, unit: int, layers: int, groups: int, design: ExperienceDesign, seed: int, round_: int
) -> list[int]:
    """Stratified probes: units walk through one seeded permutation of the (layer, KV group) pairs (head) or of
    the layers (gate), so that every state is probed about equally often over a round."""
    population = layers * groups if kind == "head" else layers
    order = list(range(population))
    random.Random(f"{seed}:{round_}:{kind}").shuffle(order)
    count = design.head_groups if kind == "head" else design.gate_layers
    return [order[(unit * count + j) % population] for j in range(min(count, population))]


# A probe: the layer whose kept set it changes, its record fields, and that kept set.
Probe = tuple[int, dict, torch.Tensor]


def head_probes(
    signals: PromptSignals,
    head_reliability: torch.Tensor,
    thresholds: torch.Tensor,
    budget: int,
    probes: list[int],
    count: int,
    rng: random.Random,
) -> list[Probe]:
    """For each probed (layer, KV group): `count` weights from HEAD_ACTIONS, each given to one query head of the
    group at a time while every other head keeps its table weight."""
    kv_heads = signals.rho.shape[1]
    group = head_reliability.shape[1] // kv_heads
    found = []
    for probe in probes:
        layer, kv_head = divmod(probe, kv_heads)
        actions = sorted(rng.sample(range(len(HEAD_ACTIONS)), min(count, len(HEAD_ACTIONS))))
        for head in range(kv_head * group, (kv_head + 1) * group):
            for action in actions:
                weights = head_reliability[layer].clone()
                weights[head] = HEAD_ACTIONS[action]
                varied = layer_scores(signals, layer, weights)
                kept = _kept(varied, gated_count(varied, float(thresholds[layer]), budget))
                found.append((layer, dict(head=head, action=action), kept))
    return found


def gate_probes(
    prompt: CalibrationPrompt,
    scores: list[torch.Tensor],
    budget: int,
    probes: list[int],
    count: int,
    rng: random.Random,
) -> list[Probe]:
    """For each probed layer: `count` thresholds from GATE_ACTIONS on the layer's current scores."""
    found = []
    for layer in probes:
        actions = sorted(rng.sample(range(len(GATE_ACTIONS)), min(count, len(GATE_ACTIONS))))
        for action in actions:
            candidates = candidate_count(scores[layer], float(GATE_ACTIONS[action]))
            row = dict(
                action=action,
                candidates=candidates,
                entropy_bin=prompt.entropy_bin,
                perplexity_bin=prompt.perplexity_bin,
            )
            found.append((layer, row, _kept(scores[layer], min(budget, candidates))))
    return found


def collect_unit(
    model: nn.Module,
    prompt: CalibrationPrompt,
    head_reliability: torch.Tensor,
    risk_thresholds: torch.Tensor,
    budget_index: int,
    budget: int,
    kind: str,
    probes: list[int],
    design: ExperienceDesign,
    rng: random.Random,
    round_: int,
    records: Records,
    batch_size: int,
) -> None:
    """Probe one (prompt, budget) under the current tables (W [L, Hq] and thresholds [L] for this prompt's risk
    bins) and append one record per probed (state, action)."""
    signals = prompt.signals
    scores = [layer_scores(signals, layer, weights) for layer, weights in enumerate(head_reliability)]
    base_kept = [_kept(s, gated_count(s, float(t), budget)) for s, t in zip(scores, risk_thresholds)]
    scorer = ContinuationScorer(model, prompt.prefilled, batch_size)
    base = scorer.base(base_kept)
    _finite(base.nll, prompt.index)
    if kind == "head":
        found = head_probes(signals, head_reliability, risk_thresholds, budget, probes, design.head_actions, rng)
    else:
        found = gate_probes(prompt, scores, budget, probes, design.gate_actions, rng)
    for layer in sorted({layer for layer, _, _ in found}):
        here = [(row, kept.numpy().tobytes(), kept) for probe_layer, row, kept in found if probe_layer == layer]
        nll_of = {base_kept[layer].numpy().tobytes(): base.nll}
        unique = {key: kept for _, key, kept in here if key not in nll_of}
        for key, nll in zip(unique, scorer.variants(base, layer, list(unique.values()))):
            nll_of[key] = _finite(nll, prompt.index)
        for row, key, _ in here:
            records.append(
                prompt=prompt.index,
                budget=budget_index,
                layer=layer,
                nll=nll_of[key],
                base_nll=base.nll,
                round=round_,
                **row,
            )
