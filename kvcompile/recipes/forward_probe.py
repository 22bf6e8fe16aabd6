"""The probe `kvcompile compile` runs before it starts: a model's forwards timed once on this machine
(`forward_costs.ForwardCosts`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvcompile.calibration.forward_costs import ForwardCosts

if TYPE_CHECKING:
    from torch import nn

PROBE_LENGTHS = (512, 1024)  # prompt lengths timed: a cost linear plus quadratic in the length through both
ROLLOUT_BATCH = 8  # continuations scored together, as `kvcompile tables` decodes its variants
ROLLOUT_TOKENS = 64
QUERY_EMBEDDINGS = 16  # lookahead queries appended in one training step
Result = TypeVar("Result")


def measure_forward_costs(model: nn.Module) -> ForwardCosts:
    """The probe (a few seconds for a model of 0.5B on 2 cores): prefills and second passes at two lengths, 8 decode
    steps, a batch of scored continuations and a training step of appended embeddings, after a warm-up of each."""
    import torch

    from kvcompile.recipes.kvcompose.attention_stats import prompt_scores

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(vocab // 4, vocab // 2, (1, max(PROBE_LENGTHS)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    prefills, passes = [], []
    with torch.no_grad():
        model(ids[:, :32], logits_to_keep=1)  # warm-up: first-call allocations are not the model's cost
        for length in PROBE_LENGTHS:
            prompt = ids[:, :length]
            prefill, out = _timed(lambda prompt=prompt: model(prompt, use_cache=True, logits_to_keep=1))
            both, _ = _timed(lambda prompt=prompt: prompt_scores(model, prompt, None))  # a prefill, then the maxima
            prefills.append(prefill / length)
            passes.append(max(both - prefill, 0.0) / length)
        cache, step = out.past_key_values, ids[:, -1:]
        started = time.perf_counter()
        for _ in range(8):
            cache = model(step, past_key_values=cache, use_cache=True).past_key_values
        decode = (time.perf_counter() - started) / 8
        rows = ids[:, :ROLLOUT_TOKENS].repeat(ROLLOUT_BATCH, 1)
        model(rows[:, :8])
        scored, _ = _timed(lambda: model(rows))
    embeddings = torch.zeros(1, QUERY_EMBEDDINGS, model.config.hidden_size, device=device, requires_grad=True)

    def query_step() -> float:
        with torch.no_grad():
            context = model(ids, use_cache=True, logits_to_keep=1).past_key_values
        started = time.perf_counter()
        out = model(inputs_embeds=embeddings, past_key_values=context, logits_to_keep=1)
        torch.autograd.grad(out.logits.sum(), embeddings)  # the model frozen: the gradient reaches the embeddings
        return time.perf_counter() - started

    query_step()  # warm-up: the first backward builds what later ones reuse
    return ForwardCosts(
        _linear_fit(prefills), _linear_fit(passes), decode, scored / (ROLLOUT_BATCH * ROLLOUT_TOKENS), query_step()
    )


def _linear_fit(per_token: list[float]) -> tuple[float, float]:
    """(a, b) with a + b x length through the per-token costs at `PROBE_LENGTHS` (b >= 0: never cheaper longer)."""
    (short, long), (low, high) = PROBE_LENGTHS, per_token
    slope = max((high - low) / (long - short), 0.0)
    return max(high - slope * long, 0.0), slope


def _timed(work: Callable[[], Result]) -> tuple[float, Result]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result
