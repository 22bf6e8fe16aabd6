"""Compressing inside the prefill (issue 20) on tiny models: each layer cut right after its attention, and a
prompt streamed in chunks with every layer cut after each, checked against an eager reference that attends by hand
to what each chunk's queries may see, and against the largest cache a hook of the test itself saw held."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import LargestCache, scorer_that_prefers
from transformers import AttentionInterface
from typer.testing import CliRunner

import kvruntime
from kvcompile.cli import app
from kvruntime import KVRuntimeError, Method
from kvruntime.engine import chunk_bounds
from kvruntime.math.selection import protect_window
from kvruntime.methods import LayerInputs, Selection, SnapKV
from kvruntime.methods.distilled import running_state_sum, token_features
from kvruntime.requests.request import KeepPlan, kept_per_head

BUDGET, WINDOW = 24, 4
ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class FixedPriority(Method):
    """A test method whose score of a token is a fixed number per (KV head, position): what every chunk keeps is
    then known without the engine (the `BUDGET` highest priorities among the positions seen so far)."""

    name = "fixed-priority"
    window: int = WINDOW
    priority: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, 0))  # [Hkv, N]

    @property
    def budgets_known_in_advance(self) -> bool:
        return True

    def layer_budgets(self, num_layers: int, plan: KeepPlan) -> list[int]:
        return [plan.keep] * num_layers

    def layer_statistics(self, layer: LayerInputs) -> torch.Tensor:
        return self.stream_scores(layer, None, None)[0]

    def stream_scores(self, layer: LayerInputs, held: torch.Tensor | None, carry: object) -> tuple[torch.Tensor, None]:
        fresh = self.priority[:, layer.start : layer.start + layer.hidden_states.shape[1]][None]
        scores = fresh if held is None else torch.cat([held, fresh], dim=-1)
        return (protect_window(scores, self.window) if layer.final else scores), None

    def select(self, statistics: list[torch.Tensor], plan: KeepPlan, prefill: object) -> Selection:
        raise AssertionError("a method whose budgets are known in advance is cut inside the prefill")


def kept_after_each_chunk(priority: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """By hand: the positions [Hkv, N] (boolean) each KV head holds after each chunk."""
    length = priority.shape[1]
    kept = []
    for index, (_, end) in enumerate(bounds):
        seen = priority[:, :end].clone()
        if index == len(bounds) - 1:
            seen[:, length - WINDOW :] = float("inf")
        mask = torch.zeros_like(priority, dtype=torch.bool)
        mask.scatter_(1, seen.topk(min(BUDGET, end), dim=1).indices, True)
        kept.append(mask)
    return kept


def reference_attention(kept: list[torch.Tensor], bounds: list[tuple[int, int]], context_length: int):
    """Eager attention in one pass over context and question: a query of chunk c sees its own chunk causally and,
    of the earlier chunks, what each KV head kept after chunk c - 1; a question token sees the context's final
    selection and the question causally."""

    def attend(module, query, key, value, attention_mask, scaling, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        length = key.shape[2]
        allowed = torch.zeros(query.shape[1], length, length, dtype=torch.bool)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        for index, (start, end) in enumerate([*bounds, (context_length, length)]):
            allowed[:, start:end, start:end] = causal[start:end, start:end]
            if index:
                earlier = kept[index - 1][:, :start].repeat_interleave(groups, 0)
                allowed[:, start:end, :start] = earlier[:, None, :]
        logits = (query @ key.transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        return (logits.softmax(-1) @ value).transpose(1, 2).contiguous(), None

    return attend


def reference_logits(model, tokens, question, kept, bounds) -> torch.Tensor:
    AttentionInterface.register("kvruntime_test_chunks", reference_attention(kept, bounds, tokens.shape[1]))
    model.set_attn_implementation("kvruntime_test_chunks")
    try:
        with torch.no_grad():
            return model(torch.cat([tokens, question], dim=1)).logits[0]
    finally:
        model.set_attn_implementation("sdpa")


def entry_bytes(model) -> int:
    """Bytes of one token's keys and values in one layer (float32)."""
    config = model.config
    return 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4


def test_chunks_put_the_remainder_first_so_that_the_last_chunk_is_whole():
    assert chunk_bounds(80, 32) == [(0, 16), (16, 48), (48, 80)]
    assert chunk_bounds(64, 32) == [(0, 32), (32, 64)]
    assert chunk_bounds(20, 32) == [(0, 20)]


@pytest.mark.parametrize("chunk", [16, 32, 80])
def test_a_streamed_prefill_and_its_question_match_an_eager_reference_of_what_each_chunk_kept(tiny, tokens, chunk):
    torch.manual_seed(3)
    length, question = tokens.shape[1], torch.tensor([[5, 17, 33, 2]])
    priority = torch.rand(tiny.config.num_key_value_heads, length)
    method = FixedPriority(priority=priority)
    largest = LargestCache(tiny)
    try:
        with kvruntime.compress(tiny, method, budget=BUDGET, prefill_chunk_size=chunk) as session:
            context = session.prefill(tokens)
            answer = context.generate(question, max_new_tokens=1, output_logits=True, return_dict_in_generate=True)
    finally:
        largest.remove()
    bounds = chunk_bounds(length, chunk)
    kept = kept_after_each_chunk(priority, bounds)
    for positions in session.kept_positions:
        held = torch.zeros_like(kept[-1]).scatter_(1, positions[0], True)
        assert torch.equal(held, kept[-1])
    reference = reference_logits(tiny, tokens, question, kept, bounds)
    torch.testing.assert_close(answer.logits[0][0], reference[-1], atol=1e-4, rtol=1e-4)
    # The cache held never exceeds the budgets plus one chunk in one layer (and the report says what was held).
    layers = tiny.config.num_hidden_layers
    bound = entry_bytes(tiny) * (layers * BUDGET + chunk) if chunk < length else entry_bytes(tiny) * length * layers
    report = session.report
    assert largest.largest <= bound and report.peak_bytes == largest.largest
    assert report.bytes_after == entry_bytes(tiny) * BUDGET * layers
    assert ("chunks" in report.cut) == (chunk < length)


def test_each_layer_is_cut_right_after_its_attention_with_the_selection_of_a_cut_at_the_end(tiny, tokens):
    class AtTheEnd(SnapKV):
        @property
        def budgets_known_in_advance(self) -> bool:
            return False

    runs = {}
    for label, method in (("per layer", SnapKV()), ("at the end", AtTheEnd())):
        largest = LargestCache(tiny)
        try:
            with kvruntime.compress(tiny, method, ratio=0.5) as session:
                output = tiny.generate(
                    tokens,
                    do_sample=False,
                    max_new_tokens=4,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
        finally:
            largest.remove()
        runs[label] = (session.report, session.kept_positions, output, largest.largest)
    (per_layer, kept, output, largest), (at_end, kept_end, output_end, largest_end) = runs.values()
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_end))
    assert torch.equal(output.sequences, output_end.sequences)
    for a, b in zip(output.logits, output_end.logits):
        torch.testing.assert_close(a, b)
    # At most one layer holds its whole prompt: (L - 1) cut layers and the one that just ran.
    layers, length = tiny.config.num_hidden_layers, tokens.shape[1]
    assert largest == per_layer.peak_bytes == entry_bytes(tiny) * ((layers - 1) * 40 + length)
    assert largest_end == at_end.peak_bytes == at_end.bytes_before == entry_bytes(tiny) * layers * length
    assert per_layer.bytes_after == at_end.bytes_after and per_layer.bytes_before == at_end.bytes_before
    assert "right after its attention" in str(per_layer) and "after the prefill" in str(at_end)


def test_distilled_streams_with_the_scores_it_has_in_one_piece():
    torch.manual_seed(0)
    hidden = torch.randn(1, 50, 8)
    whole = token_features(hidden)
    pieces, carry = [], None
    for start, end in chunk_bounds(50, 16):
        pieces.append(token_features(hidden[:, start:end], start, carry))
        carry = running_state_sum(hidden[:, start:end], start, carry)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole)


def test_streamed_distilled_at_ratio_0_9_never_holds_more_than_its_budget_and_one_chunk(tiny, tokens, tmp_path):
    path = kvruntime.save_artifact(scorer_that_prefers(tiny, 3), tmp_path / "scorer.safetensors")
    length, chunk = tokens.shape[1], 16
    largest = LargestCache(tiny)
    try:
        with kvruntime.compress(
            tiny,
            "distilled",
            ratio=0.9,
            artifacts=[path],
            options={"allocation": "uniform", "window": 8},
            prefill_chunk_size=chunk,
        ) as session:
            tiny.generate(tokens, do_sample=False, max_new_tokens=3, pad_token_id=0)
    finally:
        largest.remove()
    budget = kept_per_head(length, 8, ratio=0.9)
    assert session.report.slots_per_layer == [budget] * tiny.config.num_hidden_layers
    assert largest.largest <= entry_bytes(tiny) * (tiny.config.num_hidden_layers * budget + chunk)


@pytest.mark.parametrize(
    ("method", "options", "size", "message"),
    [
        ("snapkv", {}, 0, "prefill_chunk_size 0 must be a positive whole number"),
        ("snapkv", {}, 2.5, "prefill_chunk_size 2.5 must be a positive whole number"),
        ("snapkv", {}, 16, "smaller than snapkv's window of 32 tokens"),
        ("kvcompress", {}, 64, "kvcompress cannot stream the prefill in chunks"),
        ("kvcompose", {"mode": "dynamic"}, 64, "kvcompose cannot stream the prefill in chunks"),
    ],
)
def test_chunk_sizes_and_methods_that_cannot_stream_are_refused_in_one_line(tiny, method, options, size, message):
    with pytest.raises(KVRuntimeError, match=message):
        with kvruntime.compress(tiny, method, ratio=0.5, options=options, prefill_chunk_size=size):
            pass


def test_the_command_line_refuses_a_chunk_size_that_is_not_positive(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("some context")
    result = CliRunner().invoke(app, ["generate", "--prompt-file", str(prompt), "--prefill-chunk-size", "0"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: --prefill-chunk-size 0: give a positive number of tokens"]


@pytest.mark.integration
def test_the_default_model_streams_a_2k_prompt_at_ratio_0_9_within_its_budgets_and_one_chunk(default_model):
    from kvcompile.prompt_format import chat_frame

    model, tokenizer = default_model
    turn_start, turn_end = chat_frame(tokenizer)
    text = (ROOT / "calibration_data/prompts/passkey_2k.txt").read_text().strip()
    ids = tokenizer(turn_start + text + turn_end, return_tensors="pt").input_ids
    artifacts = [
        ROOT / f"artifacts/smollm2-135m-instruct/{k}.safetensors" for k in ("distilled_scorer", "layer_budgets")
    ]
    chunk = 256
    largest = LargestCache(model)
    try:
        with kvruntime.compress(
            model, "distilled+error-aware", ratio=0.9, artifacts=artifacts, prefill_chunk_size=chunk
        ) as session:
            output = model.generate(ids, max_new_tokens=12, do_sample=False)
    finally:
        largest.remove()
    report = session.report
    assert "25613" in tokenizer.decode(output[0, ids.shape[1] :])
    assert abs(report.entries_removed_fraction - 0.9) < 0.001 and "8 chunks" in report.cut
    one_chunk_in_one_layer = report.bytes_before // ids.shape[1] // model.config.num_hidden_layers * chunk
    assert largest.largest == report.peak_bytes <= report.bytes_after + one_chunk_in_one_layer
