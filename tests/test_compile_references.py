"""What the compile stage measures, against references written here from the definitions (issue #37): the
attention rows `kvcompile heads` captures during generation, the layer errors `kvcompile layer-errors` sums, and
`kvcompile stats`' task-aware statistics. The references read the model's own eager attention or rebuild a layer's
attention from its projections on a plain forward over the whole sequence; the compile stage's code runs the same
model with its cache and hooks. Tiny models of test_selection_references' MODELS, 8 query heads over 2 KV heads."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import CharTokenizer
from test_selection_references import (
    LENGTH,
    MODELS,
    attention_inputs,
    eager_window_attention,
    eight_head_model,
    group,
    kept,
    mean_pool,
)

from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.calibration.job import CompileJob
from kvcompile.recipes.compresskv.attention_capture import generate_with_attention_rows
from kvcompile.recipes.compresskv.layer_errors import PROBE_BUDGET, layer_errors_of_prompt
from kvcompile.recipes.kvcompose.attention_stats import RANK_QUANTILES, compile_attention_stats
from kvcompile.recipes.kvcompose.settings import StatsSettings, TaskSet
from kvruntime.methods import SemanticRetrievalHeads
from kvruntime.models.layout import model_layout

NEW_TOKENS = 6


@pytest.fixture(params=sorted(MODELS), scope="module")
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return eight_head_model(request.param)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 96, (1, LENGTH), generator=torch.Generator().manual_seed(21))


def greedy_tokens(model: torch.nn.Module, ids: torch.Tensor, count: int) -> list[int]:
    """`count` greedy tokens, each from a full forward over everything so far (no cache)."""
    sequence = ids
    with torch.no_grad():
        for _ in range(count):
            following = model(sequence).logits[0, -1].argmax()
            sequence = torch.cat([sequence, following.view(1, 1)], dim=1)
    return sequence[0, ids.shape[1] :].tolist()


def test_heads_captures_each_generated_tokens_attention_rows_over_the_prompt(model, prompt):
    """Step k's rows are the attention of the query that produced generated token k (the prompt's last token for
    the first, then generated token k - 1) over the prompt's keys, per layer and query head."""
    rows, generated = generate_with_attention_rows(model, prompt, NEW_TOKENS, eos_token_id=None)
    assert generated == greedy_tokens(model, prompt, NEW_TOKENS)
    sequence = torch.cat([prompt, torch.tensor([generated[:-1]])], dim=1)
    attention = eager_window_attention(model, sequence, NEW_TOKENS)  # per layer [Hq, steps, N + steps - 1]
    expected = torch.stack([a[..., :LENGTH] for a in attention], dim=1).permute(2, 1, 0, 3)  # [steps, L, Hq, N]
    assert rows.shape == expected.shape
    torch.testing.assert_close(rows.double(), expected, atol=1e-5, rtol=1e-4)


def layer_projections(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each attention layer's queries [Hq, N, D] and keys and values [Hkv, N, D] (after RoPE, and after the
    query/key norms where the model has them), rebuilt from the layer's input on a forward without a cache."""
    positions = torch.arange(ids.shape[1])[None]
    result = []
    for attention, inputs in zip(model_layout(model).cut_modules, attention_inputs(model, ids)):
        states = inputs.float()[None]  # back to the model's float32, exactly
        # Gemma 3's rotary embedding has one set of frequencies per layer kind, and must be told which.
        rope = inspect.signature(model.model.rotary_emb.forward).parameters.get("layer_type")
        kind = {"layer_type": attention.layer_type} if rope is not None and rope.default is rope.empty else {}
        cos, sin = model.model.rotary_emb(states, positions, **kind)
        with torch.no_grad():
            queries = rotated(
                heads(attention.q_proj(states), attention.head_dim, getattr(attention, "q_norm", None)), cos, sin
            )
            keys = rotated(
                heads(attention.k_proj(states), attention.head_dim, getattr(attention, "k_norm", None)), cos, sin
            )
            values = heads(attention.v_proj(states), attention.head_dim, None)
        result.append((queries.double(), keys.double(), values.double(), attention))
    return result


def heads(projected: torch.Tensor, head_dim: int, norm: torch.nn.Module | None) -> torch.Tensor:
    """A projection [1, N, H * D] as heads [H, N, D], through the model's per-head norm where it has one."""
    split = projected[0].view(projected.shape[1], -1, head_dim)
    return (split if norm is None else norm(split)).transpose(0, 1)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama applies it: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    return x * cos[0] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[0]


def attention_output_over(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention: torch.nn.Module, kept: list[int]
) -> torch.Tensor:
    """The layer's output (after o_proj) for one query position's queries [Hq, D] over the keys at `kept`."""
    groups = queries.shape[0] // keys.shape[0]
    mixed = []
    for head in range(queries.shape[0]):
        k, v = keys[head // groups, kept], values[head // groups, kept]
        logits = k @ queries[head] * attention.scaling
        if cap := getattr(attention.config, "attn_logit_softcapping", None):  # Gemma 2's soft cap
            logits = torch.tanh(logits / cap) * cap
        probabilities = logits.softmax(dim=-1)
        mixed.append(probabilities @ v)
    weight = attention.o_proj.weight.detach().double()
    return weight @ torch.cat(mixed)


def test_budgets_sums_each_layers_relative_output_error_over_the_decoding_steps(model, prompt):
    """Per layer: the SRH selection at the probe budget (its 4 best-scored query heads of 8, window attention of
    the last 8 prompt queries, average-pooled over 5 tokens; the window kept) plus the generated tokens, against the
    full cache; at every decoding step, ||o(kept) - o(full)|| / ||o(full)|| of the layer's attention output, summed.
    The model runs on the full cache, so every layer sees the same inputs as a plain forward."""
    head_scores = torch.rand(3, 8, generator=torch.Generator().manual_seed(22))
    errors = layer_errors_of_prompt(model, SemanticRetrievalHeads(head_scores=head_scores), prompt, NEW_TOKENS)
    generated = greedy_tokens(model, prompt, NEW_TOKENS)
    sequence = torch.cat([prompt, torch.tensor([generated[:-1]])], dim=1)
    window = eager_window_attention(model, prompt, 8)
    expected = torch.zeros(3, dtype=torch.float64)
    for layer, (queries, keys, values, attention) in enumerate(layer_projections(model, sequence)):
        chosen = sorted(range(8), key=lambda h: -float(head_scores[layer, h]))[:4]
        scores = torch.stack([mean_pool(window[layer][h].sum(dim=0), 5) for h in chosen]).mean(dim=0)
        scores[-8:] = float("inf")
        probe = scores.topk(PROBE_BUDGET).indices.tolist()
        for position in range(LENGTH, sequence.shape[1]):  # the decoding steps' query positions
            full = attention_output_over(queries[:, position], keys, values, attention, list(range(position + 1)))
            kept_entries = probe + list(range(LENGTH, position + 1))
            cut = attention_output_over(queries[:, position], keys, values, attention, kept_entries)
            expected[layer] += float((cut - full).norm() / (full.norm() + 1e-6))
    assert bool((expected > 0).all())
    torch.testing.assert_close(errors, expected, atol=1e-5, rtol=1e-3)


def test_stats_task_aware_shares_and_curves_follow_from_each_prompts_task_attention(model, tmp_path):
    """`kvcompile stats` with a task set on one prompt: each context token's score is its largest attention from any
    task token (each task fed after the context on its own), averaged over the KV group, plus the mean over KV heads;
    the layer shares are the composite-token allocation of the keep at each ratio, the head shares the unstructured
    pool's, the curves the layer's composite scores at the rank quantiles."""
    tokenizer = CharTokenizer()
    corpus = Corpus("synthetic", ("".join(chr(97 + (j * j * 7 + j // 3) % 26) for j in range(4000)),))
    tasks = TaskSet("questions", ("what came first?", "list the letters"))
    settings = StatsSettings(ratios=(0.3, 0.6), prompts=1, prompt_tokens=LENGTH)
    artifact = compile_attention_stats(CompileJob(model, tokenizer, tmp_path / "s"), corpus, settings, task_set=tasks)
    ((_, context),) = calibration_prompts(corpus, tokenizer, 1, LENGTH, 0)
    maxima = None
    for task in tasks.prompts:
        task_ids = torch.tensor([tokenizer(task).input_ids])
        rows = eager_window_attention(model, torch.cat([context, task_ids], dim=1), task_ids.shape[1])
        layers = [a[..., :LENGTH].amax(dim=1) for a in rows]  # [Hq, N] per layer
        maxima = layers if maxima is None else [torch.maximum(a, b) for a, b in zip(maxima, layers)]
    scores = [group(m, 2).mean(dim=1) for m in maxima]
    scores = [s + s.mean(dim=0, keepdim=True) for s in scores]
    curves = [s.sort(dim=-1, descending=True).values.mean(dim=0) for s in scores]
    lifted = [torch.stack(curves).amax(dim=0), *curves[1:]]  # the first layer lifted to the best of any layer
    for index, ratio in enumerate(settings.ratios):
        keep = kept(LENGTH, 32, ratio)
        layer_counts = artifact.tensors["layer_fractions"][index].double() * LENGTH
        assert_pool_winners(lifted, layer_counts, keep * 3)
        head_counts = artifact.tensors["head_fractions"][index].double().flatten() * LENGTH
        assert_pool_winners([h.sort(descending=True).values for s in scores for h in s], head_counts, keep * 6)
    ranks = (RANK_QUANTILES * (LENGTH - 1)).round().long()
    expected = torch.stack([curve[ranks] for curve in curves])
    torch.testing.assert_close(artifact.tensors["composite_curves"].double(), expected, atol=1e-6, rtol=1e-4)


def assert_pool_winners(rows: list[torch.Tensor], counts: torch.Tensor, total: int) -> None:
    """`counts` [rows] are one global pool's winners over descending `rows`: each row keeps its first counts[i]
    values, `total` in all, and nothing left out outscores anything kept (beyond float rounding: a near tie at the
    cut may go either way between the compile stage's float32 and this double reference)."""
    whole = counts.round().long().tolist()
    assert torch.allclose(counts, counts.round(), atol=1e-4) and sum(whole) == total
    kept_values = torch.cat([row[:n] for row, n in zip(rows, whole)])
    left_out = torch.cat([row[n:] for row, n in zip(rows, whole)])
    rounding = 1e-5 * float(kept_values.abs().max())
    assert float(kept_values.min()) >= float(left_out.max()) - rounding
