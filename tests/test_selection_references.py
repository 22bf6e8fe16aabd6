"""Which entries each method keeps, against an eager reference written here from the method's definition (issue
#37): per layer, per KV head, the positions kept. The reference reads attention from the model's own eager
attention weights (`output_attentions`), not from the runtime's window queries, and scores, pools, pools over
layers and picks the top entries with its own code. Tiny Llama, Qwen2, Qwen3 and hybrid Gemma 3 models with 8 query
heads over 2 KV heads, so that SRH's choice of 4 query heads out of 8 matters and a KV group has 4 query heads to
combine; the Gemma 3 model has a sliding-window layer among its three full-attention ones, which every method leaves
to the model (the references read the full-attention layers alone, issue #62)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_compilerkv_runtime import BUDGETS, reference_kept, save_tables
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvruntime
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.recording import recorded_prefill

CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# Hybrid: a sliding-window layer (window 16, shorter than the prompt) among the three full-attention ones, which are
# the three layers every method scores and cuts; the sliding one is left as the model holds it.
HYBRID = dict(num_hidden_layers=4, head_dim=8, sliding_window=16, query_pre_attn_scalar=8, pad_token_id=0,
              layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"])  # fmt: skip
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM, HYBRID),
    # Hybrid with soft-capped attention logits (eager attention): the methods' window attention must cap as it does.
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {**HYBRID, "attn_logit_softcapping": 2.0, "initializer_range": 0.2}),
}
LENGTH = 120


def eight_head_model(kind: str) -> torch.nn.Module:
    """A tiny model of `kind` (one of MODELS) with 8 query heads over 2 KV heads, 3 layers whose cache grows."""
    config_type, model_type, settings = MODELS[kind]
    torch.manual_seed(3)
    config = config_type(**{**CONFIG, **settings})
    built = model_type(config).eval()
    built.config.architectures = [model_type.__name__]
    return built


@pytest.fixture(params=sorted(MODELS), scope="module")
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return eight_head_model(request.param)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, CONFIG["vocab_size"], (1, LENGTH), generator=torch.Generator().manual_seed(5))


def eager_window_attention(model: torch.nn.Module, ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Each layer's attention probabilities of the last `window` queries over every key, [Hq, w, N], from the
    model's own eager attention."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(implementation)
    growing = list(model_layout(model).cut_layers)  # the layers the methods cut
    return [attentions[index][0, :, -window:, :].double() for index in growing]


def max_pool(row: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each token's largest value among the `kernel` tokens centred on it (fewer at the edges)."""
    half, length = kernel // 2, row.shape[-1]
    return torch.stack([row[..., max(0, i - half) : i + half + 1].amax(dim=-1) for i in range(length)], dim=-1)


def mean_pool(row: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each token's mean over the `kernel` tokens centred on it (over those that exist at the edges)."""
    half, length = kernel // 2, row.shape[-1]
    return torch.stack([row[..., max(0, i - half) : i + half + 1].mean(dim=-1) for i in range(length)], dim=-1)


def kept(length: int, window: int, ratio: float) -> int:
    """Entries per (layer, KV head): the ratio's share of the prompt, never fewer than the window."""
    return max(length - math.floor(ratio * length), window)


def assert_best(got: list[int], scores: torch.Tensor, count: int, window: int) -> None:
    """`got` is one head's `count` best positions under the reference `scores` [N], the last `window` always among
    them. Where scores tie at the cut (pooling makes neighbours share a maximum) either side is right, so the test
    is that nothing dropped outscores anything kept, beyond float rounding between the two computations."""
    length = scores.shape[-1]
    assert len(got) == count and len(set(got)) == count
    assert set(range(length - window, length)) <= set(got)
    kept_free = [t for t in got if t < length - window]
    dropped = sorted(set(range(length)) - set(got))
    if kept_free and dropped:
        rounding = 1e-5 * float(scores.abs().max())
        assert float(scores[kept_free].min()) >= float(scores[dropped].max()) - rounding, (kept_free, dropped)


def runtime_kept(
    model: torch.nn.Module, ids: torch.Tensor, method: str, memory: str, **kwargs
) -> list[list[list[int]]]:
    """What the runtime keeps per layer and KV head (positions; in masked memory, only those its mask shows)."""
    with kvruntime.compress(model, method, memory=memory, **kwargs) as session:
        context = session.prefill(ids)
    masks = context.keep_masks  # by the cache's layer index; the kept positions by the methods' layer order
    assert session.report.layers == list(model_layout(model).cut_layers)
    result = []
    for layer, positions in zip(session.report.layers, session.kept_positions):
        heads = []
        for head in range(positions.shape[1]):
            shown = positions[0, head]
            if layer in masks:
                shown = shown[masks[layer][0, head]]
            heads.append(sorted(shown.tolist()))
        result.append(heads)
    return result


def group(attention: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[Hq, ...] -> [Hkv, G, ...]: the query heads of each KV head (consecutive, as repeat_kv lays them out)."""
    return attention.reshape(kv_heads, attention.shape[0] // kv_heads, *attention.shape[1:])


@pytest.mark.parametrize("memory", ["padded", "masked"])
@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_snapkv_keeps_each_heads_best_pooled_window_attention(model, ids, memory, ratio):
    """SnapKV: window attention summed over the last 32 queries, max-pooled over 7 tokens, averaged over the KV
    group; every (layer, KV head) keeps the same number, the window included."""
    window = 32
    count = kept(LENGTH, window, ratio)
    got = runtime_kept(model, ids, "snapkv", memory, ratio=ratio)
    for layer, scores in enumerate(snapkv_scores(model, ids, window)):
        for head in range(2):
            assert_best(got[layer][head], scores[head], count, window)


def snapkv_scores(model: torch.nn.Module, ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """SnapKV's scores [Hkv, N] per layer: window attention summed over the queries, max-pooled over 7 tokens per
    query head, averaged over the KV group."""
    return [group(max_pool(a.sum(dim=1), 7), 2).mean(dim=1) for a in eager_window_attention(model, ids, window)]


def kvcompress_scores(model: torch.nn.Module, ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """KV-Compress (KVC-w): squared window attention summed over the last 8 queries, max-pooled over 7 tokens per
    query head, summed over the KV group: [Hkv, N] per layer."""
    return [group(max_pool(a.square().sum(dim=1), 7), 2).sum(dim=1) for a in eager_window_attention(model, ids, window)]


def pooled_counts(scores: list[torch.Tensor], count: int, window: int) -> list[list[int]]:
    """One pool over every (layer, KV head, token): the count * L * Hkv best entries win (the windows always)."""
    length = scores[0].shape[-1]
    entries = [(layer, head, t) for layer, s in enumerate(scores) for head in range(s.shape[0]) for t in range(length)]
    entries.sort(key=lambda e: (e[2] < length - window, -float(scores[e[0]][e[1], e[2]])))
    counts = [[0] * scores[0].shape[0] for _ in scores]
    for layer, head, _ in entries[: count * len(scores) * scores[0].shape[0]]:
        counts[layer][head] += 1
    return counts


def largest_remainder(shares: list[float], total: int) -> list[int]:
    """Integers summing to `total`, each the floor of its share with the leftovers to the largest remainders."""
    exact = [s / sum(shares) * total for s in shares]
    counts = [math.floor(e) for e in exact]
    for index in sorted(range(len(shares)), key=lambda i: -(exact[i] - counts[i]))[: total - sum(counts)]:
        counts[index] += 1
    return counts


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_kvcompress_masked_keeps_each_heads_share_of_one_global_pool(model, ids, ratio):
    window = 8
    scores = kvcompress_scores(model, ids, window)
    counts = pooled_counts(scores, kept(LENGTH, window, ratio), window)
    assert len({c for layer in counts for c in layer}) > 1  # the pool does give heads different counts here
    got = runtime_kept(model, ids, "kvcompress", "masked", ratio=ratio)
    assert [[len(head) for head in layer] for layer in got] == counts
    for layer, layer_scores in enumerate(scores):
        for head in range(2):
            assert_best(got[layer][head], layer_scores[head], counts[layer][head], window)


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_kvcompress_padded_gives_every_head_of_a_layer_the_layers_share(model, ids, ratio):
    """Padded memory: a layer's slots are its share of the pool spread evenly over its KV heads (largest
    remainder), each head filling them with its own best entries."""
    window = 8
    scores = kvcompress_scores(model, ids, window)
    counts = pooled_counts(scores, kept(LENGTH, window, ratio), window)
    layer_totals = [sum(layer) for layer in counts]
    slots = largest_remainder(layer_totals, sum(layer_totals) // 2)
    got = runtime_kept(model, ids, "kvcompress", "padded", ratio=ratio)
    assert [[len(head) for head in layer] for layer in got] == [[n, n] for n in slots]
    for layer, layer_scores in enumerate(scores):
        for head in range(2):
            assert_best(got[layer][head], layer_scores[head], slots[layer], window)


def saved(folder: Path, model: torch.nn.Module, kind: str, **tensors: torch.Tensor) -> Path:
    """An artifact of `kind` for `model` holding `tensors`, written into `folder`."""
    params = {"oracle": "test"} if kind == "distilled_scorer" else {}
    artifact = kvruntime.Artifact(kind, tensors, kvruntime.model_fingerprint(model), {"command": "test"}, params)
    return kvruntime.save_artifact(artifact, folder / f"{kind}-{len(list(folder.iterdir()))}.safetensors")


@pytest.mark.parametrize("memory", ["padded", "masked"])
def test_srh_keeps_what_its_four_best_query_heads_attend_to(model, ids, memory, tmp_path):
    """CompressKV's SRH selection: the layer's 4 highest-scored query heads (of 8), window attention of the last 8
    queries summed, average-pooled over 5 tokens, averaged over the 4 heads: one index set for every KV head."""
    window, ratio = 8, 0.6
    head_scores = torch.rand(3, 8, generator=torch.Generator().manual_seed(11))
    count = kept(LENGTH, window, ratio)
    artifacts = [saved(tmp_path, model, "srh_heads", srh_score=head_scores)]
    got = runtime_kept(model, ids, "srh", memory, ratio=ratio, artifacts=artifacts)
    for layer, attention in enumerate(eager_window_attention(model, ids, window)):
        chosen = sorted(range(8), key=lambda h: -float(head_scores[layer, h]))[:4]
        scores = torch.stack([mean_pool(attention[h].sum(dim=0), 5) for h in chosen]).mean(dim=0)
        assert got[layer][0] == got[layer][1]  # one index set for every KV head of the layer
        assert_best(got[layer][0], scores, count, window)
    # The other four heads chosen, other entries kept: the head choice is exercised.
    flipped = [saved(tmp_path, model, "srh_heads", srh_score=-head_scores)]
    assert runtime_kept(model, ids, "srh", memory, ratio=ratio, artifacts=flipped) != got


@pytest.mark.parametrize("memory", ["padded", "masked"])
def test_compresskv_keeps_srhs_choice_within_error_aware_layer_budgets(model, ids, memory, tmp_path):
    """compresskv = SRH's selection with Algorithm 1's layer budgets. Errors 1 : 1 : 2 and 48 entries per layer
    (ratio 0.6 of 120) give each layer its floor of 32 plus its share of the 3 x (48 - 32) left: 44, 44 and 56."""
    window, ratio = 8, 0.6
    head_scores = torch.rand(3, 8, generator=torch.Generator().manual_seed(12))
    artifacts = [
        saved(tmp_path, model, "srh_heads", srh_score=head_scores),
        saved(tmp_path, model, "layer_budgets", layer_error=torch.tensor([1.0, 1.0, 2.0])),
    ]
    got = runtime_kept(model, ids, "compresskv", memory, ratio=ratio, artifacts=artifacts)
    for layer, (attention, count) in enumerate(zip(eager_window_attention(model, ids, window), (44, 44, 56))):
        chosen = sorted(range(8), key=lambda h: -float(head_scores[layer, h]))[:4]
        scores = torch.stack([mean_pool(attention[h].sum(dim=0), 5) for h in chosen]).mean(dim=0)
        assert got[layer][0] == got[layer][1]
        assert_best(got[layer][0], scores, count, window)


@pytest.mark.parametrize("memory", ["padded", "masked"])
@pytest.mark.parametrize("method, window", [("snapkv", 32), ("kvcompress", 8)])
def test_a_method_with_budgets_keeps_its_own_scores_best_within_the_layer_budgets(
    model, ids, method, window, memory, tmp_path
):
    """<method>+error-aware: each KV head keeps its own best entries under the method's scores (no global pool), as
    many as its layer's error-aware budget: 44, 44 and 56 for errors 1 : 1 : 2 at 48 per layer (as above)."""
    errors = saved(tmp_path, model, "layer_budgets", layer_error=torch.tensor([1.0, 1.0, 2.0]))
    got = runtime_kept(model, ids, f"{method}+error-aware", memory, ratio=0.6, artifacts=[errors])
    scores = (snapkv_scores if method == "snapkv" else kvcompress_scores)(model, ids, window)
    for layer, count in enumerate((44, 44, 56)):
        for head in range(2):
            assert_best(got[layer][head], scores[layer][head], count, window)


def attention_inputs(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each attention layer's input (the hidden states after the layer's input norm), [N, hidden]."""
    inputs = {}

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs[module.layer_idx] = kwargs["hidden_states"][0].double()

    modules = model_layout(model).cut_modules  # the layers the methods score (no sliding-window layer)
    handles = [module.register_forward_pre_hook(keep, with_kwargs=True) for module in modules]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return [inputs[module.layer_idx] for module in modules]


def distilled_features(states: torch.Tensor) -> torch.Tensor:
    """The scorer's features of each token [N, hidden + 4]: its state, a bias, log(1 + position), whether it is the
    first token, and the cosine of its state to the sum of the states before it, the first token left out (0 for
    the first two tokens)."""
    rows = []
    for t in range(states.shape[0]):
        earlier = states[1:t].sum(dim=0)
        likeness = float(torch.nn.functional.cosine_similarity(states[t], earlier, dim=0)) if t >= 2 else 0.0
        rows.append([1.0, math.log1p(t), float(t == 0), likeness])
    return torch.cat([states, torch.tensor(rows, dtype=states.dtype)], dim=1)


@pytest.mark.parametrize("memory", ["padded", "masked"])
def test_distilled_uniform_keeps_each_heads_best_predicted_scores(model, ids, memory, tmp_path):
    """Distilled with the uniform allocation: every (layer, KV head) keeps the same number of its best tokens under
    the scorer's linear map of each token's features (random weights, so that every feature counts)."""
    window, ratio = 8, 0.7
    weights = torch.randn(3, CONFIG["hidden_size"] + 4, 2, generator=torch.Generator().manual_seed(13))
    weights[:, -4:] *= 20  # the position and first-token features as loud as the state's
    weights[:, -1] *= 10  # and the likeness to earlier tokens louder still: its small differences must show
    scorer = saved(tmp_path, model, "distilled_scorer", weights=weights)
    options = {"allocation": "uniform", "window": window, "sinks": 0, "leverage": 0.0}
    got = runtime_kept(model, ids, "distilled", memory, ratio=ratio, artifacts=[scorer], options=options)
    count = kept(LENGTH, window, ratio)
    for layer, states in enumerate(attention_inputs(model, ids)):
        scores = (distilled_features(states) @ weights[layer].double()).T  # [Hkv, N]
        for head in range(2):
            assert_best(got[layer][head], scores[head], count, window)


@pytest.mark.parametrize("ratio, counts", [(0.5, (36, 54, 90)), (0.75, (9, 27, 54))])
def test_distilled_compiled_keeps_each_heads_best_in_the_compiled_layer_shares(model, ids, ratio, counts, tmp_path):
    """Distilled with the compiled allocation: layer l keeps its compiled share of the kept cache (shares chosen to
    split exactly: at 0.5 a layer keeps 60 of 120 tokens on average, 180 over 3 layers; at 0.75, 30 and 90), each
    KV head its best tokens under the scorer."""
    window = 8
    weights = torch.randn(3, CONFIG["hidden_size"] + 4, 2, generator=torch.Generator().manual_seed(14))
    shares = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.3, 0.6]])
    scorer = saved(
        tmp_path,
        model,
        "distilled_scorer",
        weights=weights,
        layer_shares=shares,
        share_ratios=torch.tensor([0.5, 0.75]),
    )
    options = {"allocation": "compiled", "window": window, "sinks": 0, "leverage": 0.0}
    got = runtime_kept(model, ids, "distilled", "padded", ratio=ratio, artifacts=[scorer], options=options)
    assert [len(layer[0]) for layer in got] == list(counts)
    for layer, states in enumerate(attention_inputs(model, ids)):
        scores = (distilled_features(states) @ weights[layer].double()).T  # [Hkv, N]
        for head in range(2):
            assert_best(got[layer][head], scores[head], counts[layer], window)


def default_scorer(folder: Path, model: torch.nn.Module, seed: int, scale: float = 1.0) -> tuple[Path, torch.Tensor]:
    """A scorer for the shipped default: random weights times `scale` (the extra features loud, so that every one
    counts) and compiled shares 0.2 / 0.3 / 0.5 at ratio 0.5 (the teacher's floor, 0.25, recorded by default)."""
    weights = scale * torch.randn(3, CONFIG["hidden_size"] + 4, 2, generator=torch.Generator().manual_seed(seed))
    weights[:, -4:] *= 20
    weights[:, -1] *= 10
    shares = {"layer_shares": torch.tensor([[0.2, 0.3, 0.5]]), "share_ratios": torch.tensor([0.5])}
    return saved(folder, model, "distilled_scorer", weights=weights, **shares), weights


def recorded_inputs(model: torch.nn.Module, run) -> tuple[object, list[list[torch.Tensor]]]:
    """What `run()` returns, and each scored layer's attention inputs [n, hidden] of the batch's first row, one per
    forward of the layer (a chunk of a streamed prompt; a batch goes through the model a row at a time)."""
    modules = model_layout(model).cut_modules  # the layers the methods score (no sliding-window layer)
    inputs: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(len(modules))}

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs[modules.index(module)].append(kwargs["hidden_states"][0].double())

    handles = [module.register_forward_pre_hook(record, with_kwargs=True) for module in modules]
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    return result, [inputs[layer] for layer in range(len(modules))]


def replayed_kept(scores: torch.Tensor, bounds: list[tuple[int, int]], count: int, window: int) -> set[int]:
    """One KV head's kept positions by hand: after each chunk it holds its layer's `count` best entries among those
    it held (with the scores they came with) and the chunk's; the first token always, the last `window` once the
    prompt has ended."""
    length, held = bounds[-1][1], {}
    for start, end in bounds:
        for t in range(start, end):
            protected = t == 0 or (end == length and t >= length - window)
            held[t] = math.inf if protected else float(scores[t])
        held = dict(sorted(held.items(), key=lambda item: -item[1])[:count])
    return set(held)


@pytest.mark.parametrize("chunk", [None, 40], ids=["whole", "three chunks"])
def test_the_default_distilled_keeps_each_heads_best_in_every_layer_whole_and_streamed(model, ids, chunk, tmp_path):
    """The shipped default (no options: compiled shares, a 16-token window, the first token kept, no leverage),
    whole and streamed in three chunks, against a by-hand replay from each layer's attention inputs as the prefill
    fed them (a later chunk's inputs come from attention over what the earlier chunks kept), scored on the features
    of their own chunk's states. The random prompt repeats no 8-gram: no copy penalty, the shares as compiled."""
    counts = (36, 54, 90)  # ratio 0.5: 60 tokens per layer on average, shares 0.2 / 0.3 / 0.5
    scorer, weights = default_scorer(tmp_path, model, 15)
    got, inputs = recorded_inputs(
        model, lambda: runtime_kept(model, ids, "distilled", "padded", ratio=0.5, artifacts=[scorer],
                                    prefill_chunk_size=chunk)
    )  # fmt: skip
    bounds = [(0, LENGTH)] if chunk is None else [(start, start + chunk) for start in range(0, LENGTH, chunk)]
    for layer in range(3):
        assert len(inputs[layer]) == len(bounds)
        scores = (distilled_features(torch.cat(inputs[layer])) @ weights[layer].double()).T  # [Hkv, N]
        for head in range(2):
            assert set(got[layer][head]) == replayed_kept(scores[head], bounds, counts[layer], 16), (layer, head)


# A block of 30 tokens four times: every 8-gram after the first block's is a copy (0.73 of them), and the 8-gram ending
# at position t occurs again (119 - t) // 30 times after it.
REPEATING = torch.randint(3, CONFIG["vocab_size"], (30,), generator=torch.Generator().manual_seed(6)).repeat(4)[None]


def later_copies_by_hand(ids: list[int], n: int = 8) -> list[int]:
    """Per token, how many times the n-gram ending at it occurs again after it (0 for the first n - 1 tokens)."""
    grams = [tuple(ids[t - n + 1 : t + 1]) if t >= n - 1 else None for t in range(len(ids))]
    return [0 if g is None else sum(grams[u] == g for u in range(t + 1, len(ids))) for t, g in enumerate(grams)]


def run_default(model: torch.nn.Module, prompt: torch.Tensor, scorer: Path, how: str) -> list[torch.Tensor]:
    """The default at 0.5 on `prompt` [1, N], `how` it is prefilled; the positions kept per layer [Hkv, k]."""
    # The eval's shared prefill: a plain prefill recorded first, then the hooks replayed on it.
    recording = recorded_prefill(model, prompt) if how == "recorded" else None
    with kvruntime.compress(model, "distilled", ratio=0.5, artifacts=[scorer],
                            prefill_chunk_size=40 if how == "three chunks" else None) as session:  # fmt: skip
        if how == "batch row":  # beside another prompt of the same length: each row as it would be alone
            other = torch.randint(3, CONFIG["vocab_size"], prompt.shape, generator=torch.Generator().manual_seed(7))
            session.prefill(torch.cat([prompt, other]))
        elif recording is not None:
            session.compress_recording(recording)
        else:
            session.prefill(prompt)
    return [positions[0] for positions in session.kept_positions]


@pytest.mark.parametrize("how", ["whole", "three chunks", "batch row", "recorded"])
def test_the_default_on_a_prompt_that_repeats_keeps_the_last_copies_in_refloored_shares(model, how, tmp_path):
    """The shipped default on a prompt that repeats, against a by-hand replay: each token's predicted score less 0.25
    per doubling of its 8-gram's later copies (`copy_penalty`), in the compiled shares re-floored at 0.5
    (`repeating_floor`): the pooled parts 0.2 - 1/12, 0.3 - 1/12, 0.5 - 1/12 (0.75 in all) scaled to the half the
    new floor leaves, plus 1/6 each: 0.2444, 0.3111, 0.4444 of the 180 entries kept, 44 / 56 / 80 (36 / 54 / 90 for
    a prompt that does not repeat). Whole, streamed, as a batch row and through the eval's recorded prefill."""
    counts = (44, 56, 80)
    scorer, weights = default_scorer(tmp_path, model, 16, scale=0.1)  # scores close enough for the penalty to move
    if how == "batch row" and "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        with pytest.raises(kvruntime.KVRuntimeError, match="^a batch .* on a model with sliding-window layers"):
            run_default(model, REPEATING, scorer, how)  # a hybrid model's rows are refused (test_hybrid_caches.py)
        return
    kept, inputs = recorded_inputs(model, lambda: run_default(model, REPEATING, scorer, how))
    later = torch.tensor(later_copies_by_hand(REPEATING[0].tolist()), dtype=torch.float64)
    assert later[29 + 8].item() == 2 and later[119].item() == 0 and later[:7].sum().item() == 0
    bounds = [(start, start + 40) for start in range(0, LENGTH, 40)] if how == "three chunks" else [(0, LENGTH)]
    moved = 0  # heads whose kept set the penalty changes: it must not be inert on this prompt
    for layer in range(3):
        states = torch.cat(inputs[layer][: len(bounds)])  # a batch: the first row's forwards come first
        unpenalised = (distilled_features(states) @ weights[layer].double()).T
        scores = unpenalised - 0.25 * torch.log2(1 + later)
        for head in range(2):
            expected = replayed_kept(scores[head], bounds, counts[layer], 16)
            assert set(kept[layer][head].tolist()) - {-1} == expected, (layer, head)
            moved += expected != replayed_kept(unpenalised[head], bounds, counts[layer], 16)
    assert moved > 0


def test_a_quarter_of_the_8_grams_seen_before_is_repeating_and_less_is_not(tmp_path):
    """The repetition threshold's edge, through the engine: 30 distinct tokens then a copy of the first 17 has 40
    8-grams of which 10 (those ending at the copy's 8th to 17th token) were seen before: 0.25, the prompt repeats and
    its shares are re-floored; a copy one token shorter has 9 of 39 and keeps the compiled shares."""
    model = eight_head_model("llama")
    scorer, _ = default_scorer(tmp_path, model, 17)
    distinct = torch.randperm(CONFIG["vocab_size"] - 3, generator=torch.Generator().manual_seed(8))[:30] + 3
    for copied, repeats in ((17, True), (16, False)):
        prompt = torch.cat([distinct, distinct[:copied]])[None]
        with kvruntime.compress(model, "distilled", ratio=0.5, artifacts=[scorer], options={"copy_penalty": 0.0}) as s:
            s.prefill(prompt)
        note = " ".join(s.report.notes)
        assert ("floor 0.5 (the prompt repeats: 0.25 of its 8-grams)" in note) == repeats, note
        assert ("the prompt repeats" in note) == repeats


def test_a_prompt_given_as_embeddings_is_refused_where_the_default_reads_token_ids(tmp_path):
    """copy_penalty and repeating_floor read the prompt's ids, which embeddings do not have: refused in one line,
    never served without them; with both off, the embeddings are served as the ids would be."""
    model = eight_head_model("llama")
    scorer, _ = default_scorer(tmp_path, model, 18)
    embeddings = model.get_input_embeddings()(REPEATING)
    with kvruntime.compress(model, "distilled", ratio=0.5, artifacts=[scorer]) as session:
        with pytest.raises(kvruntime.KVRuntimeError, match=r"^distilled's copy_penalty=0\.25 and repeating_floor=0\.5 "
                           r"read the prompt's token ids, and a prompt given as inputs_embeds has none"):  # fmt: skip
            model(inputs_embeds=embeddings, use_cache=True)
    kept = []
    for given in ({"input_ids": REPEATING}, {"inputs_embeds": embeddings}):
        options = {"copy_penalty": 0.0, "repeating_floor": 0.25}
        with kvruntime.compress(model, "distilled", ratio=0.5, artifacts=[scorer], options=options) as session:
            with torch.no_grad():
                model(**given, past_key_values=DynamicCache(config=model.config), use_cache=True)
        kept.append([positions.tolist() for positions in session.kept_positions])
    assert kept[0] == kept[1] and len(kept[0][0][0][0]) == 36


def kvcompose_window_scores(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """KVCompose's token scores with the last 32 queries as the task [Hkv, N] per layer (eq. 14-16): each query
    head's largest attention from them, averaged over the KV group, plus the average over the KV heads."""
    grouped = [group(a.amax(dim=1), 2).mean(dim=1) for a in eager_window_attention(model, ids, 32)]
    return [scores + scores.mean(dim=0, keepdim=True) for scores in grouped]


# Compiled shares chosen to split exactly: at ratio 0.3 a head keeps 84 of 120 tokens on average (252 per KV head
# over 3 layers, 504 over the 6 heads), at 0.5 it keeps 60 (180, 360). Shares are of the prompt's 120 tokens.
COMPILED_LAYER_COUNTS = {0.3: (56, 84, 112), 0.5: (36, 60, 84)}
COMPILED_HEAD_COUNTS = {0.3: ((40, 60), (84, 84), (116, 120)), 0.5: ((36, 48), (60, 36), (60, 120))}


def kvcompose_stats(folder: Path, model: torch.nn.Module) -> Path:
    ratios = sorted(COMPILED_LAYER_COUNTS)
    layers = torch.tensor([COMPILED_LAYER_COUNTS[r] for r in ratios], dtype=torch.float64) / LENGTH
    heads = torch.tensor([COMPILED_HEAD_COUNTS[r] for r in ratios], dtype=torch.float64) / LENGTH
    ratios = torch.tensor(ratios, dtype=torch.float64)
    return saved(folder, model, "kvcompose_stats", ratios=ratios, layer_fractions=layers, head_fractions=heads)


@pytest.mark.parametrize("memory", ["padded", "masked"])
@pytest.mark.parametrize("ratio", sorted(COMPILED_LAYER_COUNTS))
def test_kvcompose_compiled_keeps_each_heads_best_in_the_compiled_layer_shares(model, ids, memory, ratio, tmp_path):
    """Composite tokens: each layer keeps its compiled share of the prompt, every KV head its own best entries
    under the window-task scores, the window included."""
    artifacts = [kvcompose_stats(tmp_path, model)]
    got = runtime_kept(model, ids, "kvcompose", memory, ratio=ratio, artifacts=artifacts)
    for layer, (scores, count) in enumerate(zip(kvcompose_window_scores(model, ids), COMPILED_LAYER_COUNTS[ratio])):
        for head in range(2):
            assert_best(got[layer][head], scores[head], count, 32)


@pytest.mark.parametrize("ratio", sorted(COMPILED_HEAD_COUNTS))
def test_kvcompose_unstructured_keeps_each_heads_best_in_its_compiled_head_share(model, ids, ratio, tmp_path):
    artifacts = [kvcompose_stats(tmp_path, model)]
    options = {"unstructured": True}
    got = runtime_kept(model, ids, "kvcompose", "masked", ratio=ratio, artifacts=artifacts, options=options)
    for layer, scores in enumerate(kvcompose_window_scores(model, ids)):
        for head in range(2):
            assert_best(got[layer][head], scores[head], COMPILED_HEAD_COUNTS[ratio][layer][head], 32)


def second_pass_scores(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """KVCompose's task-agnostic scores [Hkv, N] per layer: the prompt fed again after itself, each context token's
    largest attention from a token of the copy (per query head), averaged over the KV group, plus the average over
    the KV heads."""
    length = ids.shape[1]
    attention = eager_window_attention(model, torch.cat([ids, ids], dim=1), length)  # the copy's rows, [Hq, N, 2N]
    grouped = [group(a[..., :length].amax(dim=1), 2).mean(dim=1) for a in attention]
    return [scores + scores.mean(dim=0, keepdim=True) for scores in grouped]


def composite_layer_counts(scores: list[torch.Tensor], keep: int, floor: int = 0) -> list[int]:
    """KVCompose's global allocation: composite token r of a layer scores the mean over its KV heads of their r-th
    best scores; the first layer's composite scores are lifted to the best any layer has there; each layer's first
    `floor` composite tokens are kept whatever they score; the keep * L best composite tokens of all layers win."""
    curves = [s.sort(dim=-1, descending=True).values.mean(dim=0) for s in scores]
    curves[0] = torch.stack(curves).amax(dim=0)
    pool = [
        (math.inf if r < floor else float(curve[r]), layer)
        for layer, curve in enumerate(curves)
        for r in range(len(curve))
    ]
    pool.sort(key=lambda entry: -entry[0])
    return [sum(1 for _, layer in pool[: keep * len(scores)] if layer == index) for index in range(len(scores))]


@pytest.mark.parametrize("memory, unstructured", [("padded", False), ("masked", False), ("masked", True)])
def test_kvcompose_dynamic_keeps_the_second_passs_best_in_this_prompts_allocation(model, ids, memory, unstructured):
    """The dynamic mode scores with a second pass and allocates on this prompt: per layer (composite tokens), or
    per (layer, KV head) from one pool of every head's sorted scores (unstructured, served in masked memory)."""
    ratio = 0.6
    keep = kept(LENGTH, 32, ratio)
    scores = second_pass_scores(model, ids)
    if unstructured:  # appendix A: one pool of every (layer, KV head, token) score, no lift
        counts = pooled_counts(scores, keep, 0)
    else:
        counts = [[n, n] for n in composite_layer_counts(scores, keep)]
    assert len({n for layer in counts for n in layer}) > 1  # the allocation is not uniform here
    options = {"mode": "dynamic", "unstructured": unstructured}
    got = runtime_kept(model, ids, "kvcompose", memory, ratio=ratio, options=options)
    assert [[len(head) for head in layer] for layer in got] == counts
    for layer, layer_scores in enumerate(scores):
        for head in range(2):
            assert_best(got[layer][head], layer_scores[head], counts[layer][head], 0)  # no window kept by rule


@pytest.mark.parametrize("memory", ["padded", "masked"])
def test_distilled_dynamic_keeps_each_heads_best_in_the_pooled_allocation_with_its_floor(model, ids, memory, tmp_path):
    """Distilled's dynamic allocation: KVCompose's global pool over the exponentiated predictions (the last 8
    tokens always kept), after every layer's first quarter of the average count is granted."""
    window, ratio = 8, 0.5
    weights = torch.randn(3, CONFIG["hidden_size"] + 4, 2, generator=torch.Generator().manual_seed(14))
    weights[2, CONFIG["hidden_size"]] -= 30  # the last layer's bias: the pool alone would leave it its window
    scorer = saved(tmp_path, model, "distilled_scorer", weights=weights)
    options = {"allocation": "dynamic", "window": window, "sinks": 0, "leverage": 0.0}
    got = runtime_kept(model, ids, "distilled", memory, ratio=ratio, artifacts=[scorer], options=options)
    keep = kept(LENGTH, window, ratio)
    scores = []
    for layer, states in enumerate(attention_inputs(model, ids)):
        predicted = (distilled_features(states) @ weights[layer].double()).T.exp()  # [Hkv, N]
        predicted[:, -window:] = math.inf
        scores.append(predicted)
    counts = composite_layer_counts(scores, keep, floor=keep // 4)
    assert counts[2] == keep // 4 > window and len(set(counts)) == 3  # the floor binds, the pool decides the rest
    assert [[len(head) for head in layer] for layer in got] == [[n, n] for n in counts]
    for layer, layer_scores in enumerate(scores):
        for head in range(2):
            assert_best(got[layer][head], layer_scores[head].log(), counts[layer], window)


@pytest.mark.parametrize("memory", ["padded", "masked"])
@pytest.mark.parametrize("options", [{}, {"elastic": True}, {"utility": "head"}])
def test_compilerkv_keeps_the_specs_selection_with_eight_query_heads(model, memory, options, tmp_path):
    """CompilerKV's weighted max-pooling over 8 query heads (4 per KV head, so a head's weight within its group
    counts under the head-aware utility), its risk bins and its gate, against the spec's selection from eager
    attention (`test_compilerkv_runtime.reference_kept`), in either memory mode."""
    prompt = torch.randint(3, CONFIG["vocab_size"], (1, 160), generator=torch.Generator().manual_seed(5))
    utility = options.get("utility", "global")  # a property of the tables, not a method option
    method_options = {key: value for key, value in options.items() if key != "utility"}
    expected = reference_kept(model, prompt, 0, elastic=bool(options.get("elastic")), utility=utility)
    tables = [save_tables(model, tmp_path, utility=utility)]
    got = runtime_kept(model, prompt, "compilerkv", memory, budget=BUDGETS[0], artifacts=tables, options=method_options)
    for layer, indices in enumerate(expected):
        assert got[layer] == [indices.tolist(), indices.tolist()]  # one index set per layer, for both KV heads


@pytest.mark.parametrize("memory", ["padded", "masked"])
def test_the_window_option_sets_the_observation_window_and_what_always_stays(model, ids, memory, tmp_path):
    """`window` is an option of every method: SnapKV with window=48 scores from the last 48 queries and keeps them;
    distilled with window=40 keeps its last 40 tokens whatever they score."""
    got = runtime_kept(model, ids, "snapkv", memory, ratio=0.7, options={"window": 48})
    for layer, scores in enumerate(snapkv_scores(model, ids, 48)):
        for head in range(2):
            assert_best(got[layer][head], scores[head], kept(LENGTH, 48, 0.7), 48)
    weights = torch.randn(3, CONFIG["hidden_size"] + 4, 2, generator=torch.Generator().manual_seed(15))
    scorer = saved(tmp_path, model, "distilled_scorer", weights=weights)
    options = {"allocation": "uniform", "window": 40, "sinks": 0, "leverage": 0.0}
    got = runtime_kept(model, ids, "distilled", memory, ratio=0.7, artifacts=[scorer], options=options)
    for layer, states in enumerate(attention_inputs(model, ids)):
        scores = (distilled_features(states) @ weights[layer].double()).T
        for head in range(2):
            assert_best(got[layer][head], scores[head], kept(LENGTH, 40, 0.7), 40)
