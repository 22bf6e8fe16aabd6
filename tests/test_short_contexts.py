"""Short contexts (issue #52; kvpress #264, #265, #277: budgets rounded to zero emptied a cache): every method and
layout, with its default window and a small one, at every ratio, on prompts of 1 to 64 tokens, either keeps exactly
what the request and its window say in every layer and head, or refuses in one line. Tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compiled_artifacts, tiny_model
from test_ratio_honesty import CASES

import kvruntime
from kvruntime.registry import method_spec

LENGTHS = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64)
RATIOS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama")
    return model, compiled_artifacts(model, tmp_path_factory.mktemp("short"), RATIOS, 96)


def planned_keep(method: str, options: dict, length: int, ratio: float) -> int | None:
    """Entries each (layer, KV head) keeps on average under the request and the method's window; None where the
    window is longer than the prompt (refused: nothing to compress)."""
    window = options.get("window", method_spec(method)[0].window)
    if length < 2 or window > length:
        return None
    return max(length - math.floor(ratio * length), window)  # the ratio's entries, at least the window


@pytest.mark.parametrize("window", [None, 4], ids=["default window", "window 4"])
@pytest.mark.parametrize("method, memory, options", CASES, ids=lambda c: str(c))
def test_a_short_prompt_keeps_what_the_request_and_window_say_or_is_refused_in_one_line(
    setup, method, memory, options, window
):
    model, paths = setup
    options = {**options, **({"window": window} if window else {})}
    heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    for length in LENGTHS:
        ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(length))
        for ratio in RATIOS:
            keep = planned_keep(method, options, length, ratio)
            try:
                with kvruntime.compress(
                    model, method, ratio=ratio, memory=memory, artifacts=paths, options=options
                ) as s:
                    context = s.prefill(ids)
            except kvruntime.KVRuntimeError as refusal:
                assert keep is None and "\n" not in str(refusal), (length, ratio, str(refusal))
                continue
            case = (method, options, length, ratio)
            assert keep is not None, case  # a prompt its window does not fit is refused, never kept whole silently
            report = s.report
            assert sum(report.entries_per_layer) == keep * heads * layers, case
            for index, layer in enumerate(context.cache.layers):  # every head of every layer sees an entry
                visible = context.keep_masks.get(index, torch.ones_like(layer.keys[..., 0], dtype=torch.bool))
                assert bool((visible.sum(-1) >= 1).all()), case
            assert all(slots <= length for slots in report.slots_per_layer), case
