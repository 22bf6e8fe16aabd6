"""Smoke tests of KVCompose on the real default model: the compile stage's allocation agrees with the runtime's
dynamic allocation averaged over the same calibration prompts (a consistency check, not a reference: the
allocation's pure functions are checked by hand in test_kvcompose_math.py and the compiled selection against an
eager reference in test_selection_references.py), and the shipped statistics free the ratio asked in the runtime."""

import pathlib

import pytest
import torch
from conftest import dynamic_layer_shares

import kvruntime
from kvcompile.calibration.corpus import calibration_prompts, load_corpus
from kvcompile.calibration.job import CompileJob
from kvcompile.prompt_format import chat_frame
from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
from kvcompile.recipes.kvcompose.settings import StatsSettings

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[1]
STATS = ROOT / "artifacts" / "smollm2-135m-instruct" / "kvcompose_stats.safetensors"
PROMPT = ROOT / "calibration_data" / "prompts" / "passkey_2k.txt"


def test_the_compiled_allocation_is_the_dynamic_allocation_averaged_over_calibration_prompts(default_model, tmp_path):
    model, tokenizer = default_model
    settings = StatsSettings(ratios=(0.5, 0.9), prompts=2, prompt_tokens=384, seed=3)
    corpus = load_corpus()
    artifact = compile_attention_stats(
        CompileJob(model, tokenizer, tmp_path / "kvcompose_stats.safetensors"), corpus, settings
    )
    prompts = calibration_prompts(corpus, tokenizer, settings.prompts, settings.prompt_tokens, settings.seed)
    for index, ratio in enumerate(settings.ratios):
        compiled = artifact.tensors["layer_fractions"][index].double()
        assert torch.allclose(dynamic_layer_shares(model, prompts, ratio), compiled, atol=1e-6), ratio


def test_the_shipped_stats_free_the_requested_ratio_and_the_pass_key_survives_half(default_model):
    model, tokenizer = default_model
    turn_start, turn_end = chat_frame(tokenizer)  # the prompt file as the user's turn, as kvcompile generate sends it
    ids = tokenizer(turn_start + PROMPT.read_text().strip() + turn_end, return_tensors="pt").input_ids
    for ratio in (0.5, 0.75, 0.9):
        with kvruntime.compress(model, "kvcompose", ratio=ratio, artifacts=[STATS]) as session:
            output = model.generate(ids, max_new_tokens=12, do_sample=False)
        report = session.report
        assert abs(1 - report.bytes_after / report.bytes_before - ratio) < 0.01
        assert f"compiled allocation (task-agnostic stats, compiled ratio {ratio:g})" in str(report)
        if ratio == 0.5:
            assert "25613" in tokenizer.decode(output[0, ids.shape[1] :])
