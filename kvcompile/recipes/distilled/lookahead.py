"""Lookahead queries: n input embeddings whose attention over a context, fed right after it, is trained to match
what the oracle's second pass finds (issue #74; the idea of LookaheadKV, arXiv 2603.10899, and Judge Q, arXiv
2509.10798, embeddings only; our own code).

The model is frozen and each calibration context is prefilled once, without gradient; only the n positions carry
it. Per step, one context: the queries go through the model after its cache (eager attention, whose weights are
differentiable), and per (layer the runtime cuts, KV head) their mean attention over the context, as a distribution
over its tokens (the first and the runtime's window left out: every score keeps them), is brought to the oracle's
scores normalised the same way, in KL. The runtime feeds them the same way (`kvruntime.plumbing.second_pass.lookahead_attention`)
and averages their log-scores with the student's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvruntime.methods.distilled.method import lookahead_log_scores
from kvruntime.methods.distilled.spec import SPEC
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.cache_ops import cache_argument, restored_after

LEARNING_RATE = 0.05  # Adam's step, relative to the root mean square of the model's input embeddings
SINKS = int(SPEC.options["sinks"].default)


@contextlib.contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """The model's attention as transformers' eager implementation inside the block (its weights carry gradient)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def prefilled(model: nn.Module, ids: torch.Tensor) -> DynamicCache:
    """The cache of a plain prefill of `ids` [1, N], without gradient."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.base_model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    return cache


def appended_log_scores(
    model: nn.Module, cache: DynamicCache, queries: torch.Tensor, length: int, layers: list[int]
) -> torch.Tensor:
    """[L, Hkv, N]: the log of each context token's mean attention from `queries` [n, hidden] fed after the
    `length` tokens in `cache`, per layer the runtime cuts (`layers`); differentiable in `queries` (eager)."""
    parameter = next(model.parameters())
    with restored_after(cache), eager_attention(model):
        output = model.base_model(
            inputs_embeds=queries.to(device=parameter.device, dtype=parameter.dtype)[None],
            **cache_argument(model, cache),
            use_cache=True,
            output_attentions=True,
        )
    heads = cache.layers[layers[0]].keys.shape[1]
    return torch.stack(
        [lookahead_log_scores(output.attentions[i][..., :length].float().mean(dim=2), heads)[0] for i in layers]
    )


def kl_from_oracle(log_scores: torch.Tensor, oracle: torch.Tensor, window: int) -> torch.Tensor:
    """Mean over (layer, KV head) of KL(oracle || queries), each a distribution over the tokens between the first
    `SINKS` and the last `window` (log-scores [L, Hkv, N] both)."""
    inner = slice(SINKS, log_scores.shape[-1] - window)
    queries = log_scores[..., inner].log_softmax(dim=-1)
    target = oracle[..., inner].to(queries).log_softmax(dim=-1)
    return (target.exp() * (target - queries)).sum(dim=-1).mean()


@dataclasses.dataclass(frozen=True)
class LookaheadContext:
    """A calibration context prefilled once: its cache, the oracle's log-scores [L, Hkv, N] and its length."""

    cache: DynamicCache
    oracle: torch.Tensor
    length: int


def lookahead_contexts(
    model: nn.Module,
    tokenizer: object,
    corpus: Corpus,
    prefill_and_oracle: Callable[[torch.Tensor], tuple[DynamicCache, torch.Tensor]],
    count: int,
    tokens: int,
    seed: int,
) -> list[LookaheadContext]:
    """`count` contexts of `tokens` tokens, each prefilled by `prefill_and_oracle(ids)` (its cache and oracle
    log-scores, `distill.py`); the first k are the same for any count >= k (calibration_prompts draws in order)."""
    contexts = []
    for _, ids in tqdm(calibration_prompts(corpus, tokenizer, count, tokens, seed), desc="lookahead contexts"):
        ids = ids.to(model.device)
        contexts.append(LookaheadContext(*prefill_and_oracle(ids), ids.shape[1]))
    return contexts


def context_kl(model: nn.Module, context: LookaheadContext, queries: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """KL(oracle || queries) on one context, averaged over the layers cut and KV heads; differentiable in `queries`."""
    log_scores = appended_log_scores(model, context.cache, queries, context.length, layers)
    return kl_from_oracle(log_scores, context.oracle, SPEC.window)


def train_lookahead_queries(
    model: nn.Module,
    contexts: Sequence[LookaheadContext],
    queries: int,
    steps: int,
    seed: int,
    held_out: Sequence[LookaheadContext] = (),
) -> tuple[torch.Tensor, dict[str, float]]:
    """The queries [n, hidden] trained on `contexts` in turn (float32, on the CPU), and the KL to the oracle at the
    first step, over the last tenth and, with contexts `held_out` (never trained on), their mean KL after training
    (`kl_held_out`: how well the queries generalise)."""
    layers = list(model_layout(model).cut_layers)
    generator = torch.Generator().manual_seed(seed)
    table = model.get_input_embeddings()
    start = torch.randint(0, table.num_embeddings, (queries,), generator=generator).to(table.weight.device)
    with torch.no_grad():
        initial = table(start).float()  # what the model's embedding gives (Gemma scales it): the queries' space
    offset = torch.zeros_like(initial, requires_grad=True)
    optimizer = torch.optim.Adam([offset], lr=LEARNING_RATE * float(initial.pow(2).mean().sqrt()))
    losses = []
    requires_grad = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        for step in tqdm(range(steps), desc="lookahead queries", unit="step"):
            loss = context_kl(model, contexts[step % len(contexts)], initial + offset, layers)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        for parameter, required in zip(model.parameters(), requires_grad):
            parameter.requires_grad_(required)
    tail = losses[-max(1, steps // 10) :]
    trained = (initial + offset).detach()
    measured = {"kl_first_step": losses[0], "kl_last_tenth": sum(tail) / len(tail)}
    if held_out:
        with torch.no_grad():
            kls = [float(context_kl(model, context, trained, layers)) for context in held_out]
        measured["kl_held_out"] = sum(kls) / len(kls)
    return trained.cpu(), measured
