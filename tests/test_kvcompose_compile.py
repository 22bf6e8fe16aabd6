"""`kvcompile stats` on a tiny model: what the artifact holds, task-aware mode, resume, and refusals."""

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import CharTokenizer, tiny_model
from typer.testing import CliRunner

from kvcompile.calibration.corpus import Corpus
from kvcompile.calibration.job import CompileJob
from kvcompile.cli import app
from kvcompile.recipes.kvcompose import attention_stats
from kvcompile.recipes.kvcompose.attention_stats import compile_attention_stats
from kvcompile.recipes.kvcompose.settings import StatsSettings, TaskSet, load_task_set
from kvruntime.errors import KVRuntimeError

CORPUS = Corpus("synthetic", tuple("".join(chr(97 + (i * 3 + j * j * 7) % 26) for j in range(6000)) for i in range(2)))
SETTINGS = StatsSettings(ratios=(0.3, 0.6), prompts=4, prompt_tokens=96)
runner = CliRunner()


def test_the_artifact_holds_shares_that_sum_to_the_kept_share_and_decreasing_curves(tmp_path):
    artifact = compile_attention_stats(
        CompileJob(tiny_model("qwen2"), CharTokenizer(), tmp_path / "s.safetensors"), CORPUS, SETTINGS
    )
    t = artifact.tensors
    assert artifact.kind == "kvcompose_stats" and artifact.params["task_mode"] == "task-agnostic"
    assert t["layer_fractions"].shape == (2, 4) and t["head_fractions"].shape == (2, 4, 2)
    for index, ratio in enumerate(SETTINGS.ratios):
        keep = 96 - int(ratio * 96)
        assert float(t["layer_fractions"][index].sum()) == pytest.approx(4 * keep / 96, abs=1e-5)
        assert float(t["head_fractions"][index].sum()) == pytest.approx(8 * keep / 96, abs=1e-5)
    assert bool((t["layer_fractions"][1] <= t["layer_fractions"][0] + 1e-6).all())  # more compression, fewer kept
    assert bool((t["composite_curves"].diff(dim=-1) <= 1e-7).all())
    assert bool((t["head_score_quantiles"].diff(dim=-1) <= 1e-7).all())
    assert bool((t["layer_fraction_std"] >= 0).all())


def test_task_aware_mode_scores_with_the_task_prompts_and_records_the_mode(tmp_path):
    tasks = TaskSet("questions", ("what came first?", "list the letters"))
    aware = compile_attention_stats(
        CompileJob(tiny_model("llama"), CharTokenizer(), tmp_path / "a"), CORPUS, SETTINGS, task_set=tasks
    )
    agnostic = compile_attention_stats(
        CompileJob(tiny_model("llama"), CharTokenizer(), tmp_path / "b"), CORPUS, SETTINGS
    )
    assert aware.params["task_mode"] == "task-aware" and aware.params["task_prompts"] == 2
    assert not torch.equal(aware.tensors["composite_curves"], agnostic.tensors["composite_curves"])


def test_an_interrupted_run_resumes_to_the_identical_artifact(tmp_path, monkeypatch):
    out = tmp_path / "kvcompose_stats.safetensors"
    model = tiny_model("llama")
    straight = compile_attention_stats(CompileJob(model, CharTokenizer(), tmp_path / "straight"), CORPUS, SETTINGS)
    real, calls = attention_stats.prompt_scores, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_stats, "prompt_scores", failing)
    with pytest.raises(KeyboardInterrupt):
        compile_attention_stats(CompileJob(model, CharTokenizer(), out, checkpoint_every=2), CORPUS, SETTINGS)
    monkeypatch.setattr(attention_stats, "prompt_scores", real)
    assert out.with_name(out.name + ".partial").exists() and not out.exists()
    resumed = compile_attention_stats(
        CompileJob(model, CharTokenizer(), out, resume=True, checkpoint_every=2), CORPUS, SETTINGS
    )
    for name, tensor in straight.tensors.items():
        assert torch.equal(tensor, resumed.tensors[name]), name
    with pytest.raises(KVRuntimeError, match="other settings .*prompt_tokens"):
        compile_attention_stats(
            CompileJob(model, CharTokenizer(), out, resume=True),
            CORPUS,
            dataclasses.replace(SETTINGS, prompt_tokens=80),
        )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ratios": (0.5, 1.0)}, "strictly between 0 and 1"),
        ({"ratios": (0.6, 0.3)}, "increasing order"),
        ({"ratios": ()}, "strictly between 0 and 1"),
        ({"prompts": 0}, "--prompts must be at least 1"),
        ({"prompt_tokens": 40}, "--prompt-tokens must be at least 64"),
    ],
)
def test_bad_settings_are_refused(change, message):
    with pytest.raises(KVRuntimeError, match=message):
        dataclasses.replace(SETTINGS, **change).check()


def test_a_task_set_with_no_prompts_or_no_file_is_refused(tmp_path):
    empty = tmp_path / "tasks.txt"
    empty.write_text("\n   \n")
    with pytest.raises(KVRuntimeError, match="holds no prompts"):
        load_task_set(empty)
    with pytest.raises(KVRuntimeError, match="does not exist"):
        load_task_set(tmp_path / "missing.txt")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ratios", "0.5,1.2"], "give ratios strictly between 0 and 1"),
        (["--ratios", "0.5,x"], "expected comma-separated float values"),
        (["--task-set", "empty.txt"], "task set empty.txt holds no prompts"),
        (["--corpus", "missing"], "corpus missing does not exist"),
    ],
)
def test_stats_refuses_bad_input_in_one_line_before_loading_the_model(tmp_path, monkeypatch, args, message):
    from kvcompile import recipe

    monkeypatch.chdir(tmp_path)
    Path("empty.txt").write_text("")
    monkeypatch.setattr(
        recipe, "load_model", lambda model, **_: pytest.fail("the model was loaded before the input was checked")
    )
    before = sorted(tmp_path.iterdir())
    result = runner.invoke(app, ["stats", "--out", "stats.safetensors", *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == before
