"""Merging evicted entries into kept ones (issue #74): every method's `merge=values` and `merge=refit`."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvruntime
from kvruntime.errors import KVRuntimeError
from kvruntime.math.attention_logits import AttentionLogits
from kvruntime.math.merging import merged_values, refitted_values
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.attention import capturing_queries, per_layer_attention


def merged_one_by_one(keys: torch.Tensor, values: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """Independent reference for one head: [N, D] keys and values -> the kept entries' values [k, D], each evicted
    value added to the kept entry of highest cosine with weight max(cosine, 0), then each sum over its weights."""
    sums = {j: values[j].double().clone() for j in kept}
    weights = dict.fromkeys(kept, 1.0)
    for e in range(keys.shape[0]):
        if e in kept:
            continue
        cosines = [float(torch.nn.functional.cosine_similarity(keys[e], keys[j], dim=0)) for j in kept]
        best = max(range(len(kept)), key=lambda i: cosines[i])
        weight = max(cosines[best], 0.0)
        sums[kept[best]] += weight * values[e].double()
        weights[kept[best]] += weight
    return torch.stack([(sums[j] / weights[j]).float() for j in kept])


def test_each_evicted_value_goes_to_its_most_alike_kept_key_weighted_by_the_cosine():
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 30, 8, generator=generator), torch.randn(1, 2, 30, 8, generator=generator)
    kept = torch.stack([torch.randperm(30, generator=generator)[:7] for _ in range(2)])[None]
    merged = merged_values(keys, values, kept)
    for head in range(2):
        expected = merged_one_by_one(keys[0, head], values[0, head], kept[0, head].tolist())
        torch.testing.assert_close(merged[0, head], expected, atol=1e-5, rtol=1e-5)
    # an evicted key pointing away from every kept one leaves them as they were
    away = merged_values(
        torch.tensor([[[[1.0, 0.0], [-1.0, 0.0]]]]), torch.tensor([[[[1.0, 1.0], [9.0, 9.0]]]]), torch.tensor([[[0]]])
    )
    assert away.tolist() == [[[[1.0, 1.0]]]]


def read_one_by_one(query, keys, values, logits, seen):
    """Independent reference: one query [D] over the first `seen` entries of keys and values [N, D], capped logits."""
    weights = torch.softmax(torch.stack([logits(query @ keys[j]) for j in range(seen)]), dim=0)
    return sum(weights[j] * values[j] for j in range(seen))


def test_refit_makes_the_last_queries_read_from_the_kept_entries_what_the_whole_prompt_gave_them():
    generator = torch.Generator().manual_seed(1)
    length, count, dim = 40, 3, 8
    keys, values = (
        torch.randn(1, 2, length, dim, generator=generator),
        torch.randn(1, 2, length, dim, generator=generator),
    )
    queries = torch.randn(1, 4, count, dim, generator=generator)  # two query heads per KV head
    logits = AttentionLogits(scaling=0.4, softcap=3.0)
    window = torch.arange(length - count, length)
    kept = torch.stack([torch.cat([torch.randperm(length - count, generator=generator)[:9], window]) for _ in range(2)])
    kept = kept[None]
    refitted = refitted_values(keys, values, kept, queries, logits, ridge=1e-7)
    for query_head in range(4):
        head = query_head // 2
        kept_ids = kept[0, head].tolist()
        for j in range(count):
            seen = length - count + j + 1  # causal: the query at position N - m + j
            full = read_one_by_one(queries[0, query_head, j], keys[0, head], values[0, head], logits, seen)
            visible = [i for i, position in enumerate(kept_ids) if position < seen]
            compressed = read_one_by_one(
                queries[0, query_head, j],
                keys[0, head, kept_ids][visible],
                refitted[0, head][visible],
                logits,
                len(visible),
            )
            torch.testing.assert_close(compressed, full, atol=1e-4, rtol=1e-4)
    # a ridge far above what the queries read leaves the kept values as they were
    stiff = refitted_values(keys, values, kept, queries, logits, ridge=1e9)
    torch.testing.assert_close(stiff, values.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, dim)), atol=1e-5, rtol=0)


def plain_prefill(model, tokens, window):
    """The full cache of a plain forward and each layer's last `window` queries and logits, as the model made them."""
    modules = model_layout(model).cut_modules
    with torch.no_grad(), per_layer_attention(model), capturing_queries(modules, window) as captures:
        full = model(tokens, use_cache=True).past_key_values
    return full, [(capture.queries, capture.logits) for capture in captures]


@pytest.mark.parametrize(
    "method, chunk, merge",
    [
        ("snapkv", None, "values"),
        ("kvcompress", None, "values"),
        ("snapkv", 32, "values"),
        ("snapkv", None, "refit"),
        ("kvcompress", None, "refit"),
        ("snapkv", 32, "refit"),
    ],
)
def test_a_method_with_merge_keeps_the_same_entries_and_bytes_with_their_values_merged(tokens, method, chunk, merge):
    model = tiny_model("llama")
    held = {}
    for option in ("off", merge):
        options = {"window": 4, "merge": option}
        with kvruntime.compress(model, method, ratio=0.75, options=options, prefill_chunk_size=chunk) as session:
            context = session.prefill(tokens)
        held[option] = (context.cache, session.kept_positions, session.report.bytes_after)
    (plain, positions, size), (merged, merged_positions, merged_size) = held["off"], held[merge]
    assert merged_size == size
    assert not any(torch.allclose(a.values, b.values) for a, b in zip(plain.layers, merged.layers))
    if chunk is None:  # a prompt in one piece: the same entries, their values merged from the whole prompt's
        assert all(torch.equal(a, b) for a, b in zip(positions, merged_positions, strict=True))
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(plain.layers, merged.layers, strict=True))
        full, references = plain_prefill(model, tokens, 4)
        for layer, kept, cut, (queries, logits) in zip(full.layers, positions, merged.layers, references, strict=True):
            if merge == "values":
                expected = merged_values(layer.keys, layer.values, kept)
            else:
                expected = refitted_values(layer.keys, layer.values, kept, queries, logits)
            torch.testing.assert_close(cut.values, expected, atol=1e-5, rtol=1e-4)


def test_an_unknown_merge_is_refused_by_name():
    with pytest.raises(KVRuntimeError, match="unknown snapkv merge 'keys'"):
        with kvruntime.compress(tiny_model("llama"), "snapkv", ratio=0.5, options={"merge": "keys"}):
            pass
