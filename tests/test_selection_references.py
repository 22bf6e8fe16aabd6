"""Which entries each method keeps, against an eager reference written here from the method's definition (issue
#37): per layer, per KV head, the positions kept. The reference reads attention from the model's own eager
attention weights (`output_attentions`), not from the runtime's window queries, and scores, pools, pools over
layers and picks the top entries with its own code. Tiny Llama, Qwen2 and Qwen3 models with 8 query heads over 2
KV heads, so that SRH's choice of 4 query heads out of 8 matters and a KV group has 4 query heads to combine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import kvruntime

CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
LENGTH = 120


@pytest.fixture(params=sorted(MODELS), scope="module")
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    config_type, model_type = MODELS[request.param]
    torch.manual_seed(3)
    config = config_type(**CONFIG, **({"head_dim": 8} if request.param == "qwen3" else {}))
    built = model_type(config).eval()
    built.config.architectures = [model_type.__name__]
    return built


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
    return [layer[0, :, -window:, :].double() for layer in attentions]


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
    masks = context.keep_masks
    result = []
    for layer, positions in enumerate(session.kept_positions):
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
    """<method>+budgets: each KV head keeps its own best entries under the method's scores (no global pool), as
    many as its layer's error-aware budget: 44, 44 and 56 for errors 1 : 1 : 2 at 48 per layer (as above)."""
    errors = saved(tmp_path, model, "layer_budgets", layer_error=torch.tensor([1.0, 1.0, 2.0]))
    got = runtime_kept(model, ids, f"{method}+budgets", memory, ratio=0.6, artifacts=[errors])
    scores = (snapkv_scores if method == "snapkv" else kvcompress_scores)(model, ids, window)
    for layer, count in enumerate((44, 44, 56)):
        for head in range(2):
            assert_best(got[layer][head], scores[layer][head], count, window)


def attention_inputs(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each attention layer's input (the hidden states after the layer's input norm), [N, hidden]."""
    inputs = {}

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs[module.layer_idx] = kwargs["hidden_states"][0].double()

    handles = [layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return [inputs[layer] for layer in range(len(inputs))]


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
    options = {"allocation": "uniform"}
    got = runtime_kept(model, ids, "distilled", memory, ratio=ratio, artifacts=[scorer], options=options)
    count = kept(LENGTH, window, ratio)
    for layer, states in enumerate(attention_inputs(model, ids)):
        scores = (distilled_features(states) @ weights[layer].double()).T  # [Hkv, N]
        for head in range(2):
            assert_best(got[layer][head], scores[head], count, window)
