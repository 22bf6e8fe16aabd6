"""The runtime engine on tiny models: exactness at ratio 0, positions, per-layer lengths, memory, refusals."""

import pytest
import torch
import transformers
from conftest import TINY
from transformers import AttentionInterface, DynamicCache

import kvruntime
from kvruntime.errors import KVRuntimeError, UnsupportedModelError
from kvruntime.plumbing.cache_ops import cache_argument

GREEDY = dict(do_sample=False, max_new_tokens=6, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("method", ["snapkv", "kvcompress"])
def test_ratio_zero_gives_exactly_the_uncompressed_logits(tiny, tokens, method):
    expected = tiny.generate(tokens, **GREEDY)
    with kvruntime.compress(tiny, method, ratio=0.0) as session:
        got = tiny.generate(tokens, **GREEDY)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        assert torch.equal(a, b)
    assert session.report.bytes_freed == 0
    assert tiny.config._attn_implementation == "sdpa"  # restored after the block


def test_generated_tokens_take_their_original_positions(tiny, tokens):
    seen = []
    hook = tiny.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"][0].tolist()), with_kwargs=True
    )
    try:
        with kvruntime.compress(tiny, "snapkv", ratio=0.5) as session:
            tiny.generate(tokens, **GREEDY)
    finally:
        hook.remove()
    length = tokens.shape[1]
    assert session.report.slots_per_layer == [40] * 4  # the cache really is half as long...
    assert seen[0] == list(range(length))
    assert [step[0] for step in seen[1:]] == list(range(length, length + 5))  # ...but positions are not


def _reference_attention(kept: list[torch.Tensor], context_length: int):
    """Eager attention over the FULL uncompressed cache, restricted by hand to each layer's kept entries (by
    original position) and to causality by original position: independent of the engine's gather and masks."""

    def attend(module, query, key, value, attention_mask, scaling, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        q_len, kv_len = query.shape[2], key.shape[2]
        allowed = torch.zeros(query.shape[1], kv_len, dtype=torch.bool)
        allowed[:, context_length:] = True
        allowed[:, :context_length] = kept[module.layer_idx][0].repeat_interleave(groups, 0)
        key_pos = torch.arange(kv_len)
        query_pos = torch.arange(kv_len - q_len, kv_len)
        causal = key_pos[None, :] <= query_pos[:, None]
        logits = (query @ key.transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~(allowed[None, :, None, :] & causal[None, None]), float("-inf"))
        return (logits.softmax(-1) @ value).transpose(1, 2).contiguous(), None

    return attend


def answer_and_reference(model, tokens, question, method, memory="padded", artifacts=(), **request):
    """Question mode's answer (greedy, every step's logits) and, for each step, the logits of the full model whose
    attention sees only the entries the method kept (by original position) plus the question and the answer so far:
    the reference is fed the answer's tokens, so every step is compared, not only the first. Also the report and
    the keep masks."""
    with kvruntime.compress(model, method, memory=memory, artifacts=list(artifacts), **request) as session:
        context = session.prefill(tokens)
        kept_positions, keep_masks = session.kept_positions, dict(context.keep_masks)
        got = context.generate(question, **GREEDY)
        again = context.generate(question, **GREEDY)  # the context was restored between questions
    assert torch.equal(got.sequences, again.sequences)
    length = tokens.shape[1]
    kept = []
    for index, positions in enumerate(kept_positions):
        mask = torch.zeros(1, positions.shape[1], length, dtype=torch.bool)
        visible = keep_masks.get(index, torch.ones_like(positions, dtype=torch.bool))
        mask.scatter_(-1, positions, visible)
        kept.append(mask)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens, **cache_argument(model, cache))  # full, uncompressed context
    answer = got.sequences[:, question.shape[1] :]
    fed = torch.cat([question, answer[:, :-1]], dim=1)
    AttentionInterface.register("kvruntime_test_reference", _reference_attention(kept, length))
    implementation = model.config._attn_implementation
    model.set_attn_implementation("kvruntime_test_reference")
    try:
        with torch.no_grad():
            positions = torch.arange(length, length + fed.shape[1])[None]
            logits = model(fed, **cache_argument(model, cache), position_ids=positions).logits
    finally:
        model.set_attn_implementation(implementation)
    reference = logits[0, question.shape[1] - 1 :]
    return torch.cat(got.logits), reference, session.report, keep_masks


@pytest.mark.parametrize("memory", ["padded", "masked"])
def test_multi_token_question_on_layers_of_different_lengths_matches_reference(tiny, tokens, memory):
    question = torch.tensor([[5, 17, 33, 2, 41, 7]])
    got, reference, report, keep_masks = answer_and_reference(tiny, tokens, question, "kvcompress", memory, ratio=0.6)
    assert len(set(report.slots_per_layer)) > 1, "the test needs layers of different cache lengths"
    assert memory == "padded" or keep_masks, "the masked test needs heads that keep different counts"
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


def test_question_mode_at_ratio_zero_equals_generation_on_the_whole_prompt(tiny, tokens):
    question = torch.tensor([[5, 17, 33]])
    expected = tiny.generate(torch.cat([tokens, question], dim=1), **GREEDY)
    with kvruntime.compress(tiny, "kvcompress", ratio=0.0) as session:
        got = session.prefill(tokens).generate(question, **GREEDY)
    assert torch.equal(got.sequences[:, 3:], expected.sequences[:, tokens.shape[1] + 3 :])
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_question_outside_the_block_is_refused(tiny, tokens):
    with kvruntime.compress(tiny, "snapkv", ratio=0.5) as session:
        context = session.prefill(tokens)
    with pytest.raises(KVRuntimeError, match="inside"):
        context.generate(torch.tensor([[1, 2]]))


def test_budget_and_freed_bytes_are_real(tiny, tokens):
    with kvruntime.compress(tiny, "snapkv", budget=40) as session:
        session.prefill(tokens)
    report = session.report
    assert report.slots_per_layer == [40] * 4
    # float32 keys and values: layers x 2 x heads x tokens x head_dim x 4 bytes
    per_token = 4 * 2 * 2 * 16 * 4
    assert report.bytes_before == per_token * 80
    assert report.bytes_after == per_token * 40
    assert report.entries_removed_fraction == pytest.approx(0.5)


def test_kvcompress_budget_is_global_and_masked_mode_attends_exactly_the_budget(tiny, tokens):
    with kvruntime.compress(tiny, "kvcompress", ratio=0.5, memory="masked") as session:
        session.prefill(tokens)
    report = session.report
    assert sum(report.entries_per_layer) == 40 * 4 * 2  # exactly (1 - ratio) of all entries attended
    assert report.bytes_after == sum(report.slots_per_layer) * 2 * 2 * 16 * 4  # padded slots are what is held
    assert "memory mode masked" in str(report)


def test_hooks_and_attention_are_removed_after_the_block(tiny, tokens):
    before = tiny.generate(tokens, **GREEDY)
    with kvruntime.compress(tiny, "kvcompress", ratio=0.7):
        tiny.generate(tokens, **GREEDY)
    after = tiny.generate(tokens, **GREEDY)
    assert torch.equal(before.sequences, after.sequences)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in tiny.modules())


@pytest.mark.parametrize(
    "config, message",
    [
        (transformers.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4),
         "'bloom' does not run its attention through transformers' attention interface as sdpa or with only"),
        (transformers.LlamaConfig(**TINY, layer_types=["full_attention", "chunked_attention"] * 2),
         "'llama' has chunked_attention layers: kvruntime compresses full-attention layers"),
        (transformers.Olmo3Config(**TINY, sliding_window=8, layer_types=["sliding_attention"] * 4, pad_token_id=0),
         "every layer of model type 'olmo3' is a sliding window"),
    ],
)  # fmt: skip
def test_a_model_the_runtime_cannot_compress_is_refused_naming_why(config, message):
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=message):
        with kvruntime.compress(model, "snapkv", ratio=0.5):
            pass


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="nope", ratio=0.5), "unknown method 'nope'"),
        (dict(method="snapkv", ratio=1.0), r"outside \[0, 1\)"),
        (dict(method="snapkv", ratio=0.5, memory="paged"), "unknown memory mode"),
        (dict(method="snapkv"), "exactly one of ratio or budget"),
    ],
)
def test_bad_requests_are_refused_before_anything_changes(tiny, kwargs, message):
    with pytest.raises(KVRuntimeError, match=message):
        with kvruntime.compress(tiny, **kwargs):
            pass
    assert tiny.config._attn_implementation == "sdpa"


def test_window_scores_never_switch_the_model_to_eager_attention(tiny, tokens, monkeypatch):
    module = __import__(type(tiny).__module__, fromlist=["eager_attention_forward"])

    def forbidden(*args, **kwargs):
        raise AssertionError("eager attention was used")

    monkeypatch.setattr(module, "eager_attention_forward", forbidden)
    seen = []
    hook = tiny.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(m.config._attn_implementation), with_kwargs=True
    )
    try:
        with kvruntime.compress(tiny, "kvcompress", ratio=0.5, memory="masked") as session:
            tiny.generate(tokens, **GREEDY)
    finally:
        hook.remove()
    assert set(seen) == {"kvruntime_attention"}
    assert session.report.entries_removed_fraction == pytest.approx(0.5)


def test_budget_larger_than_the_prompt_is_refused_with_the_lengths(tiny, tokens):
    with kvruntime.compress(tiny, "snapkv", budget=500) as session:
        with pytest.raises(
            KVRuntimeError, match="budget 500 tokens per layer is larger than the prompt \\(80 tokens\\)"
        ):
            session.prefill(tokens)
