"""Collecting CompilerKV's bandit experience on calibration prompts.

Each prompt is prefilled once: its signals (alpha, rho, risks), its full cache and its continuation's NLL over the
full cache. A unit of work is one (prompt, budget): the current tables give the base selection, a few states are
probed with a sample of actions, and every probe's kept sets are decoded over (`ContinuationScorer`), selected by
the runtime's own rule (`kept_counts`: ratio-honest, or elastic). Under the ratio-honest rule the layers share the
budget, so a probe of one layer also moves the margins of the others. Probes that keep what the base keeps, or what
another probe keeps, share that rollout's NLL: exact, and many probes are such (within a KV group only the largest
head weight matters).
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch
from torch import nn
from transformers import DynamicCache

from kvcompile.recipes.compilerkv.bandit_experience import GATE_ACTIONS, HEAD_ACTIONS, Records
from kvcompile.recipes.compilerkv.continuation_nll import (
    BaseRollout,
    ContinuationScorer,
    PrefilledPrompt,
    prefilled_prompt,
)
from kvcompile.recipes.compilerkv.settings import WINDOW, ExperienceDesign
from kvruntime import KVRuntimeError
from kvruntime.math.selection import top_indices
from kvruntime.methods.compilerkv import LayerSignals, PromptSignals, layer_scores, layer_signals, prompt_signals
from kvruntime.methods.compilerkv.risk_gate import candidate_count, kept_counts, quantile_edges, risk_bin
from kvruntime.plumbing.attention import captured_logits
from kvruntime.plumbing.cache_ops import cache_argument
from kvruntime.plumbing.window import query_hooks


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """How the runtime turns the tables into kept sets, which the rollouts must follow: the layers share the budget
    (ratio-honest) or each keeps what clears its threshold (`elastic`); the spec's or the head-aware utility."""

    elastic: bool = False
    utility: str = "global"


@dataclasses.dataclass
class CalibrationPrompt:
    index: int
    signals: PromptSignals
    prefilled: PrefilledPrompt
    full_nll: float
    entropy_bin: int = 0
    perplexity_bin: int = 0


@torch.no_grad()
def prefill_with_signals(
    model: nn.Module, ids: torch.Tensor, context_tokens: int
) -> tuple[PromptSignals, DynamicCache, torch.Tensor]:
    """Prefill the first `context_tokens` tokens of `ids` with the runtime's signal hooks: the prompt's signals (on the
    CPU, where the tables and the selection are), its cache and the log-probabilities after the context's last token
    [vocab] (on the model's device)."""
    ids = ids.to(model.device)
    layers: dict[int, LayerSignals] = {}

    def gather(
        layer: int, module: nn.Module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *_: object
    ) -> None:
        signals = layer_signals(queries, keys, values, captured_logits(module))
        layers[layer] = tuple(signal.cpu() for signal in signals)  # type: ignore[assignment]

    cache = DynamicCache(config=model.config)
    with query_hooks(model, gather, window=WINDOW):
        prefix = ids[:, :context_tokens]
        logits = model(prefix, **cache_argument(model, cache), use_cache=True, logits_to_keep=WINDOW).logits
    logprobs = logits[0].float().log_softmax(dim=-1)
    window_logprobs = logprobs[:-1].gather(-1, prefix[0, -WINDOW + 1 :, None]).T  # [1, w - 1]
    return prompt_signals([layers[i] for i in range(len(layers))], window_logprobs.cpu()), cache, logprobs[-1]


@torch.no_grad()
def greedy_continuation(model: nn.Module, ids: torch.Tensor, context_tokens: int, tokens: int) -> torch.Tensor:
    """The first `context_tokens` tokens of `ids` followed by the full-cache model's own greedy continuation of them
    (`tokens` long): [1, context_tokens + tokens]."""
    prefix = ids[:, :context_tokens].to(model.device)
    return model.generate(
        prefix, attention_mask=torch.ones_like(prefix), do_sample=False, max_new_tokens=tokens,
        min_new_tokens=tokens, pad_token_id=0,
    )  # fmt: skip


def prefill_prompt(model: nn.Module, ids: torch.Tensor, context_tokens: int, index: int) -> CalibrationPrompt:
    """Prefill the first `context_tokens` tokens of `ids` [1, context_tokens + continuation], keep its cache, and run the
    continuation over the full cache (the cache and the continuation on the model's device, the kept sets chosen on
    the CPU)."""
    signals, cache, last_logprobs = prefill_with_signals(model, ids, context_tokens)
    continuation = ids[:, context_tokens:].to(model.device)
    prefilled = prefilled_prompt(model, cache, continuation, float(-last_logprobs[continuation[0, 0]]))
    return CalibrationPrompt(
        index=index, signals=signals, prefilled=prefilled, full_nll=_finite(prefilled.full_nll, index)
    )


def stratified_choice(risks: torch.Tensor, count: int, strata: tuple[int, int], seed: int) -> list[int]:
    """`count` of the candidates spread over the risk cells: candidates are binned into strata[0] entropy x
    strata[1] perplexity cells by the candidates' own quantiles, and the cells give one candidate each in turn (in a
    seeded order within a cell) until `count` are chosen, so thin cells are not crowded out by common ones.
    risks: [candidates, 2] (entropy, perplexity). Returns candidate indices in the order chosen."""
    if not 0 < count <= len(risks):
        raise ValueError(f"cannot choose {count} of {len(risks)} candidates")
    edges = [quantile_edges(risks[:, column], bins) for column, bins in enumerate(strata)]
    cells: dict[tuple[int, int], list[int]] = {}
    for index, (entropy, perplexity) in enumerate(risks.tolist()):
        cells.setdefault((risk_bin(entropy, edges[0]), risk_bin(perplexity, edges[1])), []).append(index)
    rng = random.Random(f"{seed}:strata")
    queues = [rng.sample(members, len(members)) for _, members in sorted(cells.items())]
    chosen: list[int] = []
    while len(chosen) < count:
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop())
    return chosen


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
    count = design.head_groups if kind == "head" else design.gate_layers
    if count is None:  # every state on every unit
        return list(range(population))
    order = list(range(population))
    random.Random(f"{seed}:{round_}:{kind}").shuffle(order)
    return [order[(unit * count + j) % population] for j in range(min(count, population))]


def kept_sets(
    scores: list[torch.Tensor], thresholds: list[float], budget: int, rule: SelectionRule
) -> list[torch.Tensor]:
    """Each layer's kept positions under the runtime's rule."""
    counts = kept_counts(scores, thresholds, budget, rule.elastic)
    return [_kept(layer, count) for layer, count in zip(scores, counts)]


def design_actions(kind: str, design: ExperienceDesign, rng: random.Random) -> list[int]:
    """The action indices one probed state gets: the design's own values (`head_weights`, `gate_thresholds`), else
    `head_actions` / `gate_actions` distinct points of the grid's every `action_stride`-th (its ends among them)."""
    grid = HEAD_ACTIONS if kind == "head" else GATE_ACTIONS
    values = design.head_weights if kind == "head" else design.gate_thresholds
    if values:
        indices = [int((grid - value).abs().argmin()) for value in values]
        off_grid = [v for v, i in zip(values, indices) if abs(float(grid[i]) - v) > 1e-6]
        if off_grid:
            raise KVRuntimeError(f"{kind} actions {off_grid} are not on the action grid {grid.tolist()}")
        return indices
    count = design.head_actions if kind == "head" else design.gate_actions
    points = sorted({*range(0, len(grid), design.action_stride), len(grid) - 1})
    return sorted(rng.sample(points, min(count, len(points))))


# A probe: the layer it probes, its record fields, and the kept sets of every layer it leads to.
Probe = tuple[int, dict, list[torch.Tensor]]


def head_probes(
    signals: PromptSignals,
    scores: list[torch.Tensor],
    head_reliability: torch.Tensor,
    thresholds: list[float],
    budget: int,
    rule: SelectionRule,
    probes: list[int],
    design: ExperienceDesign,
    rng: random.Random,
) -> list[Probe]:
    """For each probed (layer, KV group): the design's weights from HEAD_ACTIONS, each given to one query head of
    the group at a time while every other head keeps its table weight."""
    kv_heads = signals.rho.shape[1]
    group = head_reliability.shape[1] // kv_heads
    found = []
    for probe in probes:
        layer, kv_head = divmod(probe, kv_heads)
        actions = design_actions("head", design, rng)
        for head in range(kv_head * group, (kv_head + 1) * group):
            for action in actions:
                weights = head_reliability[layer].clone()
                weights[head] = HEAD_ACTIONS[action]
                varied = list(scores)
                varied[layer] = layer_scores(signals, layer, weights, rule.utility)
                found.append((layer, dict(head=head, action=action), kept_sets(varied, thresholds, budget, rule)))
    return found


def gate_probes(
    prompt: CalibrationPrompt,
    scores: list[torch.Tensor],
    thresholds: list[float],
    budget: int,
    rule: SelectionRule,
    probes: list[int],
    design: ExperienceDesign,
    rng: random.Random,
) -> list[Probe]:
    """For each probed layer: the design's thresholds from GATE_ACTIONS for that layer, the others unchanged."""
    found = []
    for layer in probes:
        actions = design_actions("gate", design, rng)
        for action in actions:
            varied = list(thresholds)
            varied[layer] = float(GATE_ACTIONS[action])
            row = dict(
                action=action,
                candidates=candidate_count(scores[layer], varied[layer]),
                entropy_bin=prompt.entropy_bin,
                perplexity_bin=prompt.perplexity_bin,
            )
            found.append((layer, row, kept_sets(scores, varied, budget, rule)))
    return found


def collect_unit(
    model: nn.Module,
    prompt: CalibrationPrompt,
    head_reliability: torch.Tensor,
    risk_thresholds: torch.Tensor,
    budget_index: int,
    budget: int,
    rule: SelectionRule,
    kind: str,
    probes: list[int],
    design: ExperienceDesign,
    rng: random.Random,
    round_: int,
    records: Records,
    batch_size: int,
    loss: str = "nll",
) -> None:
    """Probe one (prompt, budget) under the current tables (W [L, Hq] and thresholds [L] for this prompt's risk
    bins) and append one record per probed (state, action), with the base rollout's loss for pairing (the `nll`
    columns hold the rollouts' `loss`: the continuation's NLL, or its KL from the full cache)."""
    signals = prompt.signals
    scores = [layer_scores(signals, layer, weights, rule.utility) for layer, weights in enumerate(head_reliability)]
    thresholds = [float(t) for t in risk_thresholds]
    base_kept = kept_sets(scores, thresholds, budget, rule)
    scorer = ContinuationScorer(model, prompt.prefilled, batch_size, loss=loss)
    base = scorer.base(base_kept)
    _finite(base.loss, prompt.index)
    if kind == "head":
        found = head_probes(signals, scores, head_reliability, thresholds, budget, rule, probes, design, rng)
    else:
        found = gate_probes(prompt, scores, thresholds, budget, rule, probes, design, rng)
    nlls = variant_nlls(scorer, base, [kept for _, _, kept in found], prompt.index)
    for (layer, row, _), nll in zip(found, nlls):
        records.append(
            prompt=prompt.index,
            budget=budget_index,
            layer=layer,
            nll=nll,
            base_nll=base.loss,
            round=round_,
            **row,
        )


def variant_nlls(
    scorer: ContinuationScorer, base: BaseRollout, variants: list[list[torch.Tensor]], prompt: int
) -> list[float]:
    """The continuation NLL of each variant's kept sets (one per layer): a variant that keeps what the base keeps
    has the base's NLL, and variants that keep the same entries share one rollout (exact)."""
    nll_of = {_key(base.kept): base.loss}
    unique = {_key(kept): kept for kept in variants if _key(kept) not in nll_of}
    for key, nll in zip(unique, scorer.variants(base, list(unique.values()))):
        nll_of[key] = _finite(nll, prompt)
    return [nll_of[_key(kept)] for kept in variants]


def _key(kept: list[torch.Tensor]) -> tuple[bytes, ...]:
    return tuple(layer.numpy().tobytes() for layer in kept)
