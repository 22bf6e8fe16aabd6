"""Merging evicted entries into kept ones (issue #74): every method's `merge=values`."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvruntime
from kvruntime.errors import KVRuntimeError
from kvruntime.merging import merged_values


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


@pytest.mark.parametrize("method, chunk", [("snapkv", None), ("kvcompress", None), ("snapkv", 32)])
def test_a_method_with_merge_keeps_the_same_entries_and_bytes_with_their_values_merged(tokens, method, chunk):
    model = tiny_model("llama")
    held = {}
    for merge in ("off", "values"):
        options = {"window": 4, "merge": merge}
        with kvruntime.compress(model, method, ratio=0.75, options=options, prefill_chunk_size=chunk) as session:
            context = session.prefill(tokens)
        held[merge] = (context.cache, session.kept_positions, session.report.bytes_after)
    (plain, positions, size), (merged, merged_positions, merged_size) = held["off"], held["values"]
    assert merged_size == size
    assert not any(torch.allclose(a.values, b.values) for a, b in zip(plain.layers, merged.layers))
    if chunk is None:  # a prompt in one piece: the same entries, their values merged from the whole prompt's
        assert all(torch.equal(a, b) for a, b in zip(positions, merged_positions, strict=True))
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(plain.layers, merged.layers, strict=True))
        full = model(tokens, use_cache=True).past_key_values
        for layer, kept, cut in zip(full.layers, positions, merged.layers, strict=True):
            expected = merged_values(layer.keys, layer.values, kept)
            torch.testing.assert_close(cut.values, expected, atol=1e-5, rtol=1e-4)


def test_an_unknown_merge_is_refused_by_name():
    with pytest.raises(KVRuntimeError, match="unknown snapkv merge 'keys'"):
        with kvruntime.compress(tiny_model("llama"), "snapkv", ratio=0.5, options={"merge": "keys"}):
            pass
