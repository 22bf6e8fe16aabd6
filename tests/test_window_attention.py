import torch

from kvruntime.cache_ops import output_cache
from kvruntime.window import window_attention, window_queries


def test_window_attention_equals_eager_rows(tiny, tokens):
    """The recomputed window attention is the last rows of the model's own (eager) attention weights."""
    captured = {}

    def capture(module, args, kwargs, output):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    layers = tiny.model.layers
    handles = [layer.self_attn.register_forward_hook(capture, with_kwargs=True) for layer in layers]
    tiny.set_attn_implementation("eager")
    with torch.no_grad():
        output = tiny(tokens, output_attentions=True, use_cache=True)
    for handle in handles:
        handle.remove()
    window = 8
    for index, layer in enumerate(layers):
        queries = window_queries(layer.self_attn, *captured[index], window)
        keys = output_cache(output).layers[index].keys
        got = window_attention(queries, keys, layer.self_attn.scaling)
        expected = output.attentions[index][:, :, -window:, :]
        batch, kv_heads, groups, _, length = got.shape
        torch.testing.assert_close(
            got.reshape(batch, kv_heads * groups, window, length), expected, atol=1e-5, rtol=1e-4
        )


def test_window_attention_is_causal_inside_window():
    queries = torch.randn(1, 4, 6, 8)
    keys = torch.randn(1, 2, 20, 8)
    probs = window_attention(queries, keys, 8**-0.5)
    # query i of the window sees keys up to 20 - 6 + i
    for i in range(6):
        assert torch.all(probs[..., i, 20 - 6 + i + 1 :] == 0)
        assert torch.all(probs[..., i, : 20 - 6 + i + 1] > 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 2, 6))
