"""Smoke tests of the CompressKV compile commands on the real default model, with small grids: the artifacts' shapes,
determinism, resumption and refusals. They check no value against a reference: the math they run (SRH and classic
head scores, ROUGE recall, error-aware budgets) is checked against hand computations in test_compresskv_math.py."""

import pytest
import torch
from typer.testing import CliRunner

import kvcompile.recipes.compresskv.heads
from kvcompile.calibration.checkpoint import checkpoint_path, save_checkpoint
from kvcompile.calibration.corpus import load_corpus
from kvcompile.calibration.job import CompileJob
from kvcompile.cli import app
from kvcompile.recipes.compresskv.heads import compile_head_scores
from kvcompile.recipes.compresskv.layer_errors import compile_layer_errors
from kvcompile.recipes.compresskv.settings import HeadsSettings, LayerErrorsSettings
from kvruntime.artifacts.artifact import load_artifact, save_artifact
from kvruntime.errors import KVRuntimeError

pytestmark = pytest.mark.integration
GRID = HeadsSettings(lengths=(320,), depths=(0.2, 0.8), seed=0)
runner = CliRunner()


class Crash(Exception):
    """Stands for the process dying mid-run."""


@pytest.fixture(scope="module")
def austen():
    return load_corpus("austen")


@pytest.fixture(scope="module")
def heads(default_model, austen, tmp_path_factory):
    model, tokenizer = default_model
    out = tmp_path_factory.mktemp("heads") / "srh_heads.safetensors"
    artifact = compile_head_scores(CompileJob(model, tokenizer, out), austen, GRID)
    save_artifact(artifact, out)
    return load_artifact(out, model=model, kind="srh_heads")


def test_heads_artifact_has_the_model_shape_and_answered_probes(heads):
    assert heads.tensors["srh_score"].shape == (30, 9)
    assert heads.tensors["retrieval_score"].shape == (30, 9)
    assert int(heads.tensors["successful_probes"]) >= 3  # of 6: the model does find most needles
    assert heads.tensors["srh_score"].sum() > 0


def test_interrupted_heads_run_resumes_to_the_identical_artifact(default_model, austen, heads, tmp_path, monkeypatch):
    model, tokenizer = default_model
    out = tmp_path / "srh_heads.safetensors"
    real = kvcompile.recipes.compresskv.heads.generate_with_attention_rows
    calls, crash_at = [], [4]

    def crash_once_on_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at[0]:
            crash_at[0] = 0
            raise Crash
        return real(*args, **kwargs)

    monkeypatch.setattr(kvcompile.recipes.compresskv.heads, "generate_with_attention_rows", crash_once_on_fourth)
    with pytest.raises(Crash):
        compile_head_scores(CompileJob(model, tokenizer, out, checkpoint_every=2), austen, GRID)
    assert checkpoint_path(out).exists() and not out.exists()
    calls.clear()
    resumed = compile_head_scores(CompileJob(model, tokenizer, out, resume=True, checkpoint_every=2), austen, GRID)
    assert len(calls) == 4  # probes 3 to 6: the checkpoint (every 2 probes) held the first two
    for name in ("srh_score", "retrieval_score", "successful_probes", "probe_recall"):
        assert torch.equal(resumed.tensors[name], heads.tensors[name]), name


def test_resume_refuses_a_checkpoint_of_other_settings(default_model, austen, tmp_path):
    model, tokenizer = default_model
    out = tmp_path / "srh_heads.safetensors"
    save_checkpoint(out, {"srh": torch.zeros(30, 9)}, {"next_probe": 1}, {"seed": 99})
    with pytest.raises(KVRuntimeError, match="other settings"):
        compile_head_scores(CompileJob(model, tokenizer, out, resume=True), austen, GRID)


def test_layer_budgets_compile_is_deterministic(default_model, austen, heads, tmp_path):
    model, tokenizer = default_model
    settings = LayerErrorsSettings(prompts=2, prompt_tokens=192, new_tokens=4, seed=0)
    first = compile_layer_errors(CompileJob(model, tokenizer, tmp_path / "a.safetensors"), austen, heads, settings)
    second = compile_layer_errors(CompileJob(model, tokenizer, tmp_path / "b.safetensors"), austen, heads, settings)
    assert first.tensors["layer_error"].shape == (30,)
    assert torch.equal(first.tensors["layer_error"], second.tensors["layer_error"])
    assert first.tensors["layer_error"].sum().item() == pytest.approx(1.0, abs=1e-5)
    assert (first.tensors["layer_error"] > 0).all()


def test_heads_command_refuses_a_corpus_too_short_for_the_grid(tmp_path):
    (tmp_path / "short.txt").write_text("A very short book. It ends here.")
    result = runner.invoke(
        app, ["heads", "--corpus", str(tmp_path / "short.txt"), "--out", str(tmp_path / "h.safetensors")]
    )
    assert result.exit_code == 2
    assert "too short for" in result.output and len(result.output.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_layer_errors_command_refuses_heads_of_another_model(tmp_path):
    from test_cli import tiny_artifact

    heads_path = tiny_artifact(tmp_path / "srh_heads.safetensors")
    result = runner.invoke(app, ["layer-errors", "--heads", str(heads_path), "--out", str(tmp_path / "b.safetensors")])
    assert result.exit_code == 2
    assert "compiled for another model" in result.output
    assert not (tmp_path / "b.safetensors").exists()
