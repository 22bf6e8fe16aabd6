"""Window attention from the queries the model computed (captured where its attention runs), on every decoder
architecture of the tests: the last rows of the model's own eager attention weights, whatever the architecture
does to its queries (Qwen3's and Gemma's per-head norms, OLMo 2's norm over the whole projection, Phi-3's fused
projection, Granite's attention multiplier, SmolLM3's layers without RoPE, Gemma's query scalar); and kvruntime's
attention function gives the model's own outputs, sliding-window layers included."""

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model

from kvruntime.math.attention_logits import AttentionLogits
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.attention import captured_logits, capturing_queries, per_layer_attention
from kvruntime.plumbing.cache_ops import output_cache
from kvruntime.plumbing.window import query_hooks, window_attention


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_window_attention_equals_eager_rows(kind, tokens):
    """The window attention of the captured queries is the last rows of the model's own eager attention weights."""
    model = tiny_model(kind)
    window, captured = 8, {}

    def keep(layer, module, queries, keys, values, *_):
        captured[layer] = (queries.clone(), keys.clone(), captured_logits(module))

    with query_hooks(model, keep, window=window), torch.no_grad():
        model(tokens, use_cache=True)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        output = model(tokens, output_attentions=True, use_cache=True)
    modules = model_layout(model).cut_modules
    assert sorted(captured) == list(range(len(modules))) and modules
    for position, module in enumerate(modules):
        queries, keys, scaling = captured[position]
        torch.testing.assert_close(keys, output_cache(output).layers[module.layer_idx].keys, atol=1e-5, rtol=1e-4)
        got = window_attention(queries, keys, scaling)
        expected = output.attentions[module.layer_idx][:, :, -window:, :]
        batch, kv_heads, groups, _, length = got.shape
        torch.testing.assert_close(
            got.reshape(batch, kv_heads * groups, window, length), expected, atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_kvruntimes_attention_gives_the_models_own_outputs(kind, tokens):
    """Its masks built per layer (a sliding-window layer's band included, the prompt longer than the window) give
    the logits of transformers' own sdpa, over a prefill and a question after it in the same cache."""
    model = tiny_model(kind)
    question = tokens[:, :7] + 1
    outputs = []
    for ours in (False, True):
        with per_layer_attention(model) if ours else torch.no_grad(), torch.no_grad():
            first = model(tokens, use_cache=True)
            after = model(question, past_key_values=output_cache(first), use_cache=True)
        outputs.append((first.logits, after.logits))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=1e-5, rtol=1e-4)


def test_window_attention_is_causal_inside_window():
    queries = torch.randn(1, 4, 6, 8)
    keys = torch.randn(1, 2, 20, 8)
    probs = window_attention(queries, keys, AttentionLogits(8**-0.5))
    # query i of the window sees keys up to 20 - 6 + i
    for i in range(6):
        assert torch.all(probs[..., i, 20 - 6 + i + 1 :] == 0)
        assert torch.all(probs[..., i, : 20 - 6 + i + 1] > 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 2, 6))


def test_captured_window_queries_do_not_hold_the_layers_whole_queries(tokens):
    """A capture of the last queries holds their own bytes, not the prompt's: a view would keep every layer's whole
    query tensor alive until its next call (the default model: 4.7 MB per layer at 2k tokens)."""
    model = tiny_model("llama")
    modules = model_layout(model).cut_modules
    window = 4
    assert tokens.shape[1] > window
    with per_layer_attention(model), capturing_queries(modules, window) as captures, torch.no_grad():
        model(tokens, use_cache=True)
    for capture in captures:
        assert capture.queries.shape[2] == window
        held = capture.queries.untyped_storage().nbytes()
        assert held == capture.queries.numel() * capture.queries.element_size()
