"""KVzap's KVzip+ target (the second pass's `kvzip_plus`) against a reference written from its definition, token by
token, on an eager forward over context + task; the distilled oracle built on it, and the teacher
(`distilled:scores=oracle`) replaying it on the prompt."""

import pytest
import torch
from conftest import CharTokenizer, scorer_that_prefers, tiny_model
from transformers import DynamicCache

import kvruntime
from kvcompile.recipes.distilled.distill import oracle_prefix, prompt_features_and_targets
from kvruntime import save_artifact
from kvruntime.math.composite_tokens import kv_head_scores
from kvruntime.plumbing.second_pass import kv_head_max, task_attention_maxima
from kvruntime.requests.request import kept_per_head


def _eager_inputs_and_attentions(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list, tuple]:
    """Each attention layer's input hidden states [T, hidden] and its eager attention probabilities [Hq, T, T]."""
    inputs = {}

    def keep(module, args, kwargs, output):
        inputs[module.layer_idx] = kwargs["hidden_states"][0]

    handles = [layer.self_attn.register_forward_hook(keep, with_kwargs=True) for layer in model.model.layers]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
        for handle in handles:
            handle.remove()
    return [inputs[i] for i in sorted(inputs)], tuple(a[0] for a in attentions)


def _reference_kvzip_plus(model: torch.nn.Module, ids: torch.Tensor, context: int) -> list[torch.Tensor]:
    """s_hi = max over task tokens j of a_hji / |h_j| * |W_O^h v_hi|, looped over heads and tokens: [Hq, context]."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    inputs, attentions = _eager_inputs_and_attentions(model, ids)
    scores = []
    for layer, (h, a) in enumerate(zip(inputs, attentions)):
        attention = model.model.layers[layer].self_attn
        values = attention.v_proj(h).view(-1, kv_heads, head_dim)  # no RoPE on values
        layer_scores = torch.zeros(heads, context)
        for head in range(heads):
            block = attention.o_proj.weight[:, head * head_dim : (head + 1) * head_dim]
            for i in range(context):
                contribution = (block @ values[i, head // (heads // kv_heads)]).norm()
                weighted = a[head, context:, i] / h[context:].norm(dim=-1)
                layer_scores[head, i] = weighted.max() * contribution
        scores.append(layer_scores)
    return scores


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [5, 512])
def test_kvzip_plus_is_the_largest_output_weighted_attention_from_the_task(kind, chunk):
    model = tiny_model(kind)
    context = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(5))
    task = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(6))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context, past_key_values=cache, use_cache=True)
        expected = _reference_kvzip_plus(model, torch.cat([context, task], dim=1), context.shape[1])
    got = task_attention_maxima(model, cache, task, context.shape[1], chunk=chunk, target="kvzip_plus")
    assert cache.get_seq_length() == context.shape[1]
    for layer in range(len(expected)):
        torch.testing.assert_close(got[layer][0], expected[layer], rtol=1e-4, atol=1e-7)
    # A different quantity from the attention alone: the ranking of some head changes.
    plain = task_attention_maxima(model, cache, task, context.shape[1], target="attention")
    assert any(not torch.equal(p[0].argsort(dim=-1), g[0].argsort(dim=-1)) for p, g in zip(plain, got, strict=True))


def test_kv_head_max_takes_the_largest_score_of_each_kv_heads_query_heads():
    scores = torch.tensor([[[1.0, 5.0], [3.0, 2.0], [0.5, 0.1], [0.2, 0.75]]])  # [B=1, Hq=4, N=2]
    assert kv_head_max(scores, 2).tolist() == [[[3.0, 5.0], [0.5, 0.75]]]


def test_the_kvzip_plus_oracle_targets_the_log_of_the_group_max_after_the_repeat_instruction():
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(8))
    prefix = oracle_prefix(tokenizer, "kvzip_plus")
    assert len(prefix) > 10 and oracle_prefix(tokenizer, "reconstruction") == []
    task = torch.cat([torch.tensor([prefix]), ids], dim=1)
    expected = _reference_kvzip_plus(model, torch.cat([ids, task], dim=1), ids.shape[1])
    features, targets = prompt_features_and_targets(model, tokenizer, ids, "kvzip_plus")
    assert len(features) == 4 and targets.shape == (4, 2, 30)
    for layer, scores in enumerate(expected):
        torch.testing.assert_close(targets[layer].float(), kv_head_max(scores[None], 2)[0].log(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("oracle", ["kvzip_plus", "reconstruction"])
def test_the_teacher_keeps_each_heads_best_tokens_by_its_oracle_replayed_on_the_prompt(tiny, tokens, tmp_path, oracle):
    prefix = [] if oracle == "reconstruction" else [7, 8, 9, 10]
    scorer = scorer_that_prefers(tiny, tiny.config.hidden_size + 1)  # the student would keep the newest tokens
    scorer.params.update(oracle=oracle, task_prefix=prefix)
    path = save_artifact(scorer, tmp_path / "s.safetensors")
    options = {"scores": "oracle", "allocation": "uniform", "window": 8, "sinks": 0}
    with kvruntime.compress(tiny, "distilled", ratio=0.5, artifacts=[path], options=options) as session:
        session.prefill(tokens)
    length, window = tokens.shape[1], 8
    replay = torch.cat([tokens, torch.tensor([prefix], dtype=tokens.dtype), tokens], dim=1)
    if oracle == "kvzip_plus":
        per_head = [kv_head_max(s[None], 2)[0] for s in _reference_kvzip_plus(tiny, replay, length)]
    else:
        _, attentions = _eager_inputs_and_attentions(tiny, replay)
        per_head = [kv_head_scores(a[None, :, length:, :length].amax(dim=-2), 2)[0] for a in attentions]
    keep = kept_per_head(length, window, ratio=0.5)
    assert session.report.slots_per_layer == [keep] * len(per_head)
    for positions, scores in zip(session.kept_positions, per_head, strict=True):
        for head in range(2):
            best = scores[head, : length - window].topk(keep - window).indices.tolist()
            assert sorted(positions[0, head].tolist()) == sorted([*best, *range(length - window, length)])


def test_the_teacher_of_a_scorer_that_does_not_record_its_instruction_is_refused(tiny, tokens, tmp_path):
    scorer = scorer_that_prefers(tiny, 0)
    scorer.params.update(oracle="kvzip_plus")
    path = save_artifact(scorer, tmp_path / "s.safetensors")
    with pytest.raises(kvruntime.KVRuntimeError, match="recompile it with `kvcompile distill`"):
        with kvruntime.compress(tiny, "distilled", ratio=0.5, artifacts=[path], options={"scores": "oracle"}) as s:
            s.prefill(tokens)
