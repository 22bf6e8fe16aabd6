"""Lookahead queries (issue #74): learned embeddings fed after the prompt, scored by their attention over it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CharTokenizer, scorer_that_prefers, tiny_model
from distributed_worker import CORPUS

import kvruntime
from kvcompile.calibration.corpus import calibration_prompts
from kvcompile.calibration.job import CompileJob
from kvcompile.recipes.distilled.distill import prefill_features_and_targets, with_lookahead_queries
from kvcompile.recipes.distilled.lookahead import (
    appended_log_scores,
    eager_attention,
    lookahead_contexts,
    prefilled,
    train_lookahead_queries,
)
from kvcompile.recipes.distilled.recipe import DistillRecipe
from kvcompile.recipes.distilled.settings import DistillSettings
from kvruntime import save_artifact
from kvruntime.errors import ArtifactError
from kvruntime.methods.distilled import DistilledScorer
from kvruntime.methods.distilled.method import lookahead_log_scores
from kvruntime.methods.distilled.oracle import LOOKAHEAD_ON
from kvruntime.methods.distilled.spec import SPEC
from kvruntime.models.layout import model_layout
from kvruntime.plumbing.recording import recorded_prefill
from kvruntime.plumbing.second_pass import lookahead_attention

WINDOW = 8
STUDENT_WEIGHT = 0.01


def appended_in_one_forward(model: torch.nn.Module, ids: torch.Tensor, queries: torch.Tensor) -> list[torch.Tensor]:
    """Independent reference: the prompt and the queries in one eager forward, the queries' attention rows over the
    prompt averaged over them, per layer whose cache grows: [Hq, N]."""
    with eager_attention(model), torch.no_grad():
        embedded = torch.cat([model.get_input_embeddings()(ids), queries[None]], dim=1)
        attentions = model.base_model(inputs_embeds=embedded, output_attentions=True).attentions
    length = ids.shape[1]
    return [attentions[m.layer_idx][0, :, length:, :length].mean(dim=1) for m in model_layout(model).cut_modules]


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_the_queries_attention_is_theirs_appended_to_the_prompt_and_leaves_the_cache_as_it_was(kind):
    model = tiny_model(kind)
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    queries = 3 * torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    cache = prefilled(model, ids)
    held = [layer.keys.clone() for layer in cache.layers]
    means = lookahead_attention(model, cache, queries, ids.shape[1])
    for mean, reference in zip(means, appended_in_one_forward(model, ids, queries), strict=True):
        torch.testing.assert_close(mean[0], reference, atol=1e-5, rtol=1e-4)
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, held))
    # the compile stage's differentiable scores are the runtime's
    compiled = appended_log_scores(model, cache, queries, ids.shape[1], list(model_layout(model).cut_layers))
    runtime = torch.stack([lookahead_log_scores(m, cache.layers[0].keys.shape[1])[0] for m in means])
    torch.testing.assert_close(compiled, runtime, atol=1e-4, rtol=1e-4)


def scorer_with_queries(model: torch.nn.Module, queries: torch.Tensor, on: str | None = None) -> kvruntime.Artifact:
    """A scorer whose student prefers the oldest tokens, slightly (the queries' scores decide, ties are broken),
    with lookahead queries (for the prompts `on` names, when given)."""
    artifact = scorer_that_prefers(model, model.config.hidden_size + 1, sign=-STUDENT_WEIGHT)
    artifact.tensors["lookahead_queries"] = queries
    if on is not None:
        artifact.params["lookahead_on"] = on
    return artifact


def test_the_selection_ranks_the_mean_of_the_students_and_the_queries_log_scores(tokens, tmp_path):
    model = tiny_model("llama")
    queries = 4 * torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    path = save_artifact(scorer_with_queries(model, queries), tmp_path / "s.safetensors")
    options = {"window": WINDOW, "copy_penalty": 0.0}
    kept = {}
    for lookahead in ("auto", "off"):
        with kvruntime.compress(
            model, "distilled", ratio=0.5, artifacts=[path], options={**options, "lookahead": lookahead}
        ) as session:
            session.prefill(tokens)
        kept[lookahead] = session.kept_positions
        slots = session.report.slots_per_layer
    length = tokens.shape[1]
    student = -STUDENT_WEIGHT * torch.log1p(torch.arange(length, dtype=torch.float32))
    means = lookahead_attention(model, prefilled(model, tokens), queries, length)
    differs = False
    for layer, (mean, count) in enumerate(zip(means, slots)):
        combined = 0.5 * (student + lookahead_log_scores(mean, 2)[0])  # [Hkv, N]
        combined[:, -WINDOW:] = combined[:, :1] = float("inf")  # the window and the first token stay
        for head in range(2):
            expected = sorted(combined[head].topk(count).indices.tolist())
            assert kept["auto"][layer][0, head].tolist() == expected
            differs |= kept["off"][layer][0, head].tolist() != expected
    assert differs, "the queries changed nothing: the test would pass without them"


def test_a_prompt_streamed_in_chunks_is_cut_by_the_student_alone(tokens, tmp_path):
    model = tiny_model("llama")
    queries = 4 * torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    path = save_artifact(scorer_with_queries(model, queries), tmp_path / "s.safetensors")
    kept = {}
    for lookahead in ("auto", "off"):
        options = {"window": WINDOW, "copy_penalty": 0.0, "lookahead": lookahead}
        with kvruntime.compress(
            model, "distilled", ratio=0.5, artifacts=[path], options=options, prefill_chunk_size=32
        ) as session:
            session.prefill(tokens)
        kept[lookahead] = [p.tolist() for p in session.kept_positions]
    assert kept["auto"] == kept["off"]


@pytest.mark.parametrize(
    "queries, message",
    [
        (torch.zeros(4, 63), "lookahead_queries has shape [4, 63]"),
        (torch.zeros(4, 64, 1), "lookahead_queries has shape"),
        (torch.zeros(300, 64), "expected [1-256 queries, 64]"),
    ],
)
def test_lookahead_queries_of_another_shape_are_refused_when_the_scorer_is_read(tmp_path, queries, message):
    artifact = scorer_with_queries(tiny_model("llama"), queries)
    path = save_artifact(artifact, tmp_path / "bad.safetensors")
    with pytest.raises(ArtifactError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DistilledScorer.from_artifact(kvruntime.read_artifact(path))


def test_training_brings_the_queries_attention_toward_the_oracle():
    model = tiny_model("llama")

    def oracle(ids: torch.Tensor) -> tuple[object, torch.Tensor]:
        cache, _, targets = prefill_features_and_targets(model, CharTokenizer(), ids, "reconstruction")
        return cache, targets

    contexts = lookahead_contexts(model, CharTokenizer(), CORPUS, oracle, count=2, tokens=64, seed=1)
    trained, losses = train_lookahead_queries(model, contexts, queries=4, steps=60, seed=1)
    assert trained.shape == (4, model.config.hidden_size)
    assert losses["kl_last_tenth"] < 0.8 * losses["kl_first_step"]
    assert all(p.requires_grad for p in model.parameters())  # the model is left as it was


def test_held_out_contexts_are_never_trained_on_and_give_the_trained_queries_kl_on_them():
    model = tiny_model("llama")
    tokenizer = CharTokenizer()

    def oracle(ids: torch.Tensor) -> tuple[object, torch.Tensor]:
        cache, _, targets = prefill_features_and_targets(model, tokenizer, ids, "reconstruction")
        return cache, targets

    contexts = lookahead_contexts(model, tokenizer, CORPUS, oracle, count=4, tokens=64, seed=1)
    first_two = lookahead_contexts(model, tokenizer, CORPUS, oracle, count=2, tokens=64, seed=1)
    assert [torch.equal(a.oracle, b.oracle) for a, b in zip(contexts, first_two)] == [True, True]
    alone, alone_losses = train_lookahead_queries(model, contexts[:2], queries=4, steps=20, seed=1)
    trained, losses = train_lookahead_queries(model, contexts[:2], queries=4, steps=20, seed=1, held_out=contexts[2:])
    torch.testing.assert_close(trained, alone, rtol=0, atol=0)  # the held-out contexts took no step
    assert "kl_held_out" not in alone_losses
    # independent reference: each unseen context and the queries in one eager forward, KL(oracle || queries) by hand
    # over the tokens between the first and the last window, averaged over layers, KV heads and contexts
    heads = model.config.num_key_value_heads
    kls = []
    for _, ids in calibration_prompts(CORPUS, tokenizer, 4, 64, 1)[2:]:
        _, targets = oracle(ids)
        for attention, target in zip(appended_in_one_forward(model, ids, trained), targets, strict=True):
            grouped = attention.view(heads, -1, ids.shape[1]).mean(dim=1)[:, 1 : ids.shape[1] - SPEC.window]
            wanted = target[:, 1 : ids.shape[1] - SPEC.window].softmax(dim=-1)
            got = grouped.clamp(min=1e-12) / grouped.clamp(min=1e-12).sum(dim=-1, keepdim=True)
            kls.append(float((wanted * (wanted.log() - got.log())).sum(dim=-1).mean()))
    assert losses["kl_held_out"] == pytest.approx(sum(kls) / len(kls), rel=3e-3)  # float32 sums of near-uniform rows


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])  # gemma3_text: sliding layers of 16 tokens
def test_queries_fed_inside_the_prefill_leave_its_output_as_it_was_and_cut_what_a_forward_of_their_own_cuts(
    tokens, tmp_path, kind
):
    model = tiny_model(kind)
    queries = 4 * torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    path = save_artifact(scorer_with_queries(model, queries), tmp_path / "s.safetensors")
    arguments = dict(ratio=0.5, artifacts=[path], options={"window": WINDOW, "copy_penalty": 0.0})
    question = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = model(tokens, use_cache=True)
    plain_held = [layer.keys.shape[2] for layer in plain.past_key_values.layers]
    with kvruntime.compress(model, "distilled", **arguments) as session:
        with torch.no_grad():
            inside = model(tokens, use_cache=True)  # the queries go inside this forward
        torch.testing.assert_close(inside.logits, plain.logits, atol=1e-5, rtol=1e-4)
        held = dict(enumerate(plain_held)) | dict(zip(session.report.layers, session.report.slots_per_layer))
        assert [layer.keys.shape[2] for layer in inside.past_key_values.layers] == list(held.values())
        generated = model.generate(tokens, max_new_tokens=3, do_sample=False, pad_token_id=0)  # its own arguments
        assert int(generated[0, tokens.shape[1]]) == int(plain.logits[0, -1].argmax())
        fused_answer = session.prefill(tokens).generate(question, max_new_tokens=6, do_sample=False)[0]
        fused_positions = session.kept_positions
    recording = recorded_prefill(model, tokens)  # a plain prefill: the queries get a forward of their own
    with kvruntime.compress(model, "distilled", **arguments) as session:
        own_answer = session.compress_recording(recording).generate(question, max_new_tokens=6, do_sample=False)[0]
        for fused, own in zip(fused_positions, session.kept_positions, strict=True):
            assert torch.equal(fused, own)
    assert fused_answer.tolist() == own_answer.tolist()
    whole = {**arguments, "ratio": None, "budget": tokens.shape[1]}  # nothing to cut: the queries' entries still go
    with kvruntime.compress(model, "distilled", **whole), torch.no_grad():
        cache = model(tokens, use_cache=True).past_key_values
    assert [layer.keys.shape[2] for layer in cache.layers] == plain_held
    assert [layer.get_seq_length() for layer in cache.layers] == [
        layer.get_seq_length() for layer in plain.past_key_values.layers
    ]  # where the next token goes
    for layer, own in zip(cache.layers, plain.past_key_values.layers, strict=True):  # the prompt's own entries
        torch.testing.assert_close(layer.keys, own.keys, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])  # gemma3_text: the shipped rule's model, hybrid
def test_queries_compiled_for_prompts_that_do_not_repeat_leave_a_repeating_prompt_to_the_student(
    tokens, tmp_path, kind
):
    model = tiny_model(kind)
    queries = 4 * torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    paths = {
        on: save_artifact(scorer_with_queries(model, queries, on), tmp_path / f"{on}.safetensors")
        for on in LOOKAHEAD_ON
    }
    repeating = torch.cat([tokens[:, :40], tokens[:, :40]], dim=1)  # over half its 8-grams seen before
    kept, reports = {}, {}
    for prompt, ids in (("repeating", repeating), ("unique", tokens)):
        for on, lookahead in (("all", "auto"), ("all", "off"), ("non-repeating", "auto")):
            options = {"window": WINDOW, "copy_penalty": 0.0, "lookahead": lookahead}
            with kvruntime.compress(model, "distilled", ratio=0.5, artifacts=[paths[on]], options=options) as session:
                session.prefill(ids)
            kept[prompt, on, lookahead] = [p.tolist() for p in session.kept_positions]
            reports[prompt, on, lookahead] = session.report
    assert kept["repeating", "non-repeating", "auto"] == kept["repeating", "all", "off"]
    assert kept["repeating", "all", "auto"] != kept["repeating", "all", "off"]  # the queries would have changed it
    assert kept["unique", "non-repeating", "auto"] == kept["unique", "all", "auto"] != kept["unique", "all", "off"]
    alone = reports["repeating", "non-repeating", "auto"]
    assert alone.cut == "per layer, right after its attention"  # nothing to wait for: cut inside the prefill
    assert any("the student alone: the prompt repeats" in note for note in alone.notes)
    assert "lookahead queries" in " ".join(reports["unique", "non-repeating", "auto"].notes)
    with (
        kvruntime.compress(
            model,
            "distilled",
            ratio=0.5,
            artifacts=[paths["non-repeating"]],
            options={"copy_penalty": 0.0, "floor": 0.5},
        ),
        torch.no_grad(),
        pytest.raises(kvruntime.KVRuntimeError, match="lookahead queries .* read the prompt's token ids"),
    ):
        model(inputs_embeds=model.get_input_embeddings()(tokens), use_cache=True)  # no ids: is it repeating?


@pytest.mark.parametrize("on", ["never", ["all"], 1])
def test_a_scorer_naming_other_prompts_for_its_queries_is_refused_when_it_is_read(tmp_path, on):
    model = tiny_model("llama")
    artifact = scorer_with_queries(model, torch.zeros(2, model.config.hidden_size), on)
    path = save_artifact(artifact, tmp_path / "bad.safetensors")
    with pytest.raises(ArtifactError, match="lookahead_on .* is not one of all, non-repeating"):
        DistilledScorer.from_artifact(kvruntime.read_artifact(path))


def test_distill_records_the_prompts_its_queries_are_for(tmp_path):
    model = tiny_model("llama")
    settings = DistillSettings(
        lookahead_queries=2, lookahead_steps=2, lookahead_prompts=1, lookahead_tokens=64, lookahead_on="non-repeating"
    )
    fitted = scorer_that_prefers(model, model.config.hidden_size + 1)
    artifact = with_lookahead_queries(fitted, CompileJob(model, CharTokenizer(), tmp_path / "run"), CORPUS, settings)
    scorer = DistilledScorer.from_artifact(artifact)
    assert scorer.lookahead_on == "non-repeating" and scorer.lookahead_queries.shape == (2, model.config.hidden_size)
    recorded = artifact.params["lookahead"]  # the default's held-out contexts measured and said
    held_out = settings.lookahead_held_out
    assert held_out > 0 and recorded["held_out"] == held_out and recorded["kl_held_out"] > 0
    whole = dataclasses.replace(  # what a whole distill run adds before the queries
        artifact,
        tensors={**artifact.tensors, "held_out_r2": torch.full((len(model_layout(model).cut_modules), 5), 0.5)},
        params={**artifact.params, "share_prompts": "all 4 calibration prompts"},
    )
    assert f"{recorded['kl_held_out']:.3f} on {held_out} contexts never trained on" in DistillRecipe().describe(whole)
