"""Integration tests of the distilled scorer on the real default model: the shipped scorer in the runtime, question
mode (the context compressed before the question is seen), and the student against its oracle on a short prompt."""

import pathlib

import pytest
import torch

import kvruntime
from kvcompile.calibration.corpus import calibration_prompts, load_corpus
from kvcompile.prompt_format import chat_frame
from kvcompile.recipes.distilled.distill import prompt_features_and_targets
from kvruntime.methods.distilled import DistilledScorer, predicted_scores

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[1]
SCORER = ROOT / "artifacts" / "smollm2-135m-instruct" / "distilled_scorer.safetensors"
CONTEXT = ROOT / "calibration_data" / "prompts" / "passkey_2k_context.txt"


def test_the_shipped_scorer_holds_the_ratio_and_the_pass_key_survives_question_agnostic(default_model):
    model, tokenizer = default_model
    turn_start, turn_end = chat_frame(tokenizer)
    context = tokenizer(turn_start + CONTEXT.read_text().strip(), return_tensors="pt", add_special_tokens=False)
    question = tokenizer(
        "\n\nWhat is the pass key? Answer with the number." + turn_end, return_tensors="pt", add_special_tokens=False
    ).input_ids
    with kvruntime.compress(model, "distilled", ratio=0.75, artifacts=[SCORER]) as session:
        compressed = session.prefill(context.input_ids)
        output = compressed.generate(question, max_new_tokens=12, do_sample=False)
    report = session.report
    assert report.bytes_after == pytest.approx(report.bytes_before / 4, rel=0.02)
    answer = tokenizer.decode(output[0, question.shape[1] :], skip_special_tokens=True)
    assert "25613" in answer, answer


def test_the_student_ranks_a_held_out_passage_like_its_oracle(default_model):
    model, tokenizer = default_model
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(SCORER, model=model))
    ((_, ids),) = calibration_prompts(load_corpus("moby-dick"), tokenizer, 1, 512, seed=11)
    features, targets = prompt_features_and_targets(model, tokenizer, ids, scorer.oracle)
    for layer in (0, 15, 29):
        predicted = predicted_scores(features[layer][None], scorer.weights[layer].double())[0]
        ranks = lambda t: t.argsort(dim=-1).argsort(dim=-1).double()  # noqa: E731
        correlation = torch.corrcoef(torch.stack([ranks(predicted).flatten(), ranks(targets[layer]).flatten()]))[0, 1]
        assert correlation > 0.5, (layer, float(correlation))
