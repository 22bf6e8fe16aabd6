"""A model's artifacts found by the fingerprint of its weights, read before the model loads, however the model is
given (a name, a GGUF file renamed or not, a saved folder), and `kvcompile compile`'s plan (issue #75)."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import shutil
import subprocess
import typing
from pathlib import Path

import pytest
import torch
from conftest import save_char_tokenizer, tiny_model
from safetensors.torch import load_file, save_file
from test_cli import tiny_artifact
from test_default_model_cache import tiny_spec, write_tiny_model
from test_refusals_before_torch import gguf_bytes
from typer.testing import CliRunner

import kvcompile.shipped
from kvcompile.calibration.forward_costs import ForwardCosts
from kvcompile.cli import app
from kvcompile.cli.compile_plan import ESTIMATE_MARGIN, fitted_scale, kinds_needed, methods_of
from kvcompile.recipe import artifact_folder, artifact_folders, default_artifact, model_identity, store_folder
from kvcompile.recipes.compilerkv.settings import DESIGNS, TablesSettings
from kvcompile.recipes.compresskv.settings import HeadsSettings, LayerErrorsSettings
from kvcompile.recipes.distilled.settings import DistillSettings
from kvcompile.recipes.forward_probe import measure_forward_costs
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvcompile.settings import (
    command_line_arguments,
    command_line_default,
    command_line_fields,
    command_line_kind,
    flag_of,
    settings_from_command_line,
)
from kvruntime import Artifact, save_artifact
from kvruntime.artifacts.bundle import artifact_files
from kvruntime.artifacts.fingerprint import folder_fingerprint, model_fingerprint
from kvruntime.errors import KVRuntimeError
from kvruntime.models import default_model as dm
from kvruntime.models import model_loading

runner = CliRunner()


def saved(model: torch.nn.Module, folder: Path) -> str:
    model.save_pretrained(folder)
    save_char_tokenizer(folder)
    return str(folder)


def other_models_artifact(path: Path) -> Path:
    """An srh_heads artifact of the same shape as `tiny_artifact`'s, compiled for other weights (seed 1)."""
    fingerprint = model_fingerprint(tiny_model("llama", seed=1))
    tensors = {"srh_score": torch.rand(4, 4), "probes": torch.tensor([3])}
    artifact = Artifact("srh_heads", tensors, fingerprint, {"command": "test", "seed": 0}, {"grid": [1, 2]})
    return save_artifact(artifact, path)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3_text", "gemma2"])
def test_a_folders_fingerprint_is_read_without_loading_and_is_the_loaded_models(kind, tmp_path):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path / "a")
    assert folder_fingerprint(tmp_path / "a") == model_fingerprint(model)
    tiny_model(kind, seed=1).save_pretrained(tmp_path / "b")
    assert folder_fingerprint(tmp_path / "b").weights_hash != model_fingerprint(model).weights_hash


def test_weights_stored_under_other_names_are_known_only_once_loaded(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({f"renamed.{name}": tensor for name, tensor in weights.items()}, tmp_path / "model.safetensors")
    assert folder_fingerprint(tmp_path) is None


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A shipped artifacts/ folder holding the tiny model's artifacts and another model's, and an empty store."""
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "shipped" / "artifacts"
    tiny_artifact(folder / "tiny" / "srh_heads.safetensors")
    other_models_artifact(folder / "other" / "srh_heads.safetensors")
    monkeypatch.setattr(kvcompile.shipped, "shipped_folder", lambda name: folder)
    return folder


def test_one_set_of_weights_saved_twice_has_one_store_folder_and_finds_its_shipped_artifacts(shipped, tmp_path):
    first = saved(tiny_model("llama"), tmp_path / "a" / "m")
    renamed = shutil.copytree(first, tmp_path / "b" / "renamed")
    other = saved(tiny_model("llama", seed=1), tmp_path / "c" / "m")  # another model of the same name
    assert store_folder(first) == store_folder(str(renamed)) != store_folder(other)
    assert store_folder(first).name == f"LlamaForCausalLM-{model_fingerprint(tiny_model('llama')).weights_hash}"
    assert artifact_folders(first) == (store_folder(first), shipped / "tiny")
    assert artifact_folders(other) == (store_folder(other), shipped / "other")
    assert default_artifact(str(renamed), "srh_heads") == shipped / "tiny" / "srh_heads.safetensors"
    compiled = store_folder(first) / "srh_heads.safetensors"  # what the user compiled wins over the shipped one
    tiny_artifact(compiled)
    assert default_artifact(str(renamed), "srh_heads") == compiled


def test_a_renamed_gguf_is_converted_once_and_finds_what_its_weights_have(shipped, tmp_path, monkeypatch, capsys):
    converted = []

    def dequantise(gguf: Path, staging: Path) -> dict:
        converted.append(gguf)
        return write_tiny_model(staging, tiny_spec())

    monkeypatch.setattr(dm, "dequantise_gguf", dequantise)
    first = tmp_path / "model.Q4_K_M.gguf"
    first.write_bytes(gguf_bytes())
    renamed = tmp_path / "elsewhere" / "weights.bin"  # a GGUF by its magic bytes, whatever its name
    renamed.parent.mkdir()
    shutil.copy(first, renamed)
    assert model_identity(str(first)) == model_identity(str(renamed)) is not None
    assert store_folder(str(first)) == store_folder(str(renamed)) and len(converted) == 1
    folder = model_loading.weights_folder(str(renamed))
    said = capsys.readouterr().err
    assert f"converting model.Q4_K_M (0 MB GGUF) once into {folder}" in said and "GB of float32 weights" in said


@pytest.fixture
def prompt(tmp_path: Path) -> str:
    (tmp_path / "prompt.txt").write_text("The pass key is 12345. Remember it. What is the pass key?")
    return str(tmp_path / "prompt.txt")


def never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("the model's weights were loaded")

    monkeypatch.setattr(model_loading, "_load_folder", refuse)


def test_generate_names_every_missing_artifact_and_the_one_command_before_loading(
    shipped, tmp_path, prompt, monkeypatch
):
    model = saved(tiny_model("llama", seed=2), tmp_path / "m")  # nothing compiled or shipped for it
    never_loaded(monkeypatch)
    result = runner.invoke(app, ["generate", "--model", model, "--method", "compresskv", "--prompt-file", prompt])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "method 'compresskv' needs srh_heads and layer_budgets" in result.output
    assert f"`kvcompile compile --model {model} --methods compresskv`" in result.output
    assert str(store_folder(model)) in result.output


def test_another_models_artifact_is_refused_before_the_weights_load(shipped, tmp_path, prompt, monkeypatch):
    model = saved(tiny_model("llama"), tmp_path / "m")
    never_loaded(monkeypatch)
    args = ["generate", "--model", model, "--method", "srh", "--prompt-file", prompt]
    result = runner.invoke(app, [*args, "--artifact", str(shipped / "other")])
    assert result.exit_code == 2 and "compiled for another checkpoint of LlamaForCausalLM" in result.output


def test_another_checkpoints_artifact_given_with_force_is_applied_with_one_warning(shipped, tmp_path, prompt):
    """The check before the model loads refuses; with --force it leaves the warning to where the artifact is applied."""
    import warnings

    model = saved(tiny_model("llama"), tmp_path / "m")
    args = ["generate", "--model", model, "--method", "srh", "--prompt-file", prompt, "--max-new-tokens", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runner.invoke(app, [*args, "--artifact", str(shipped / "other"), "--force"])
    assert result.exit_code == 0, result.output
    forced = [str(w.message) for w in caught if "applied anyway because force was set" in str(w.message)]
    assert len(forced) == 1 and "compiled for another checkpoint of LlamaForCausalLM" in forced[0]


def test_eval_refuses_another_models_artifacts_before_the_weights_load(shipped, tmp_path, monkeypatch):
    from test_own_suite import ROWS, write_jsonl

    model = saved(tiny_model("llama"), tmp_path / "m")
    never_loaded(monkeypatch)
    suite = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    args = ["eval", "--model", model, "--suite", str(suite), "--methods", "srh", "--out", str(tmp_path / "run")]
    result = runner.invoke(app, [*args, "--artifacts", str(shipped / "other")])
    assert result.exit_code == 2 and "compiled for another checkpoint of LlamaForCausalLM" in result.output
    assert not (tmp_path / "run").exists()


def test_a_folder_of_artifacts_gives_its_artifacts_and_one_without_any_is_refused(shipped, tmp_path, prompt):
    assert artifact_files([shipped / "tiny"]) == [shipped / "tiny" / "srh_heads.safetensors"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(KVRuntimeError, match="empty is a folder without artifacts"):
        artifact_files([tmp_path / "empty"])
    model = saved(tiny_model("llama"), tmp_path / "m")
    args = ["generate", "--model", model, "--method", "srh", "--prompt-file", prompt, "--max-new-tokens", "2"]
    result = runner.invoke(app, [*args, "--artifact", str(shipped / "tiny")])
    assert result.exit_code == 0 and "compression report: srh" in result.output, result.output


def test_compile_plans_what_the_methods_need_in_order_and_runs_only_what_is_missing(shipped, tmp_path, monkeypatch):
    assert kinds_needed(["compresskv"]) == ["srh_heads", "layer_budgets"] and kinds_needed(["snapkv"]) == []
    everything = ["srh_heads", "layer_budgets", "compilerkv_tables", "kvcompose_stats", "distilled_scorer"]
    assert kinds_needed(methods_of("all")) == everything
    model = saved(tiny_model("llama"), tmp_path / "m")  # its srh_heads shipped
    ran = []
    monkeypatch.setattr(
        "subprocess.run", lambda command: ran.append(command[3:]) or type("Done", (), {"returncode": 0})
    )
    result = runner.invoke(app, ["compile", "--model", model, "--methods", "compresskv,kvcompose", "--dry-run"])
    assert result.exit_code == 0 and ran == [], result.output
    assert f"srh_heads: have ({shipped / 'tiny' / 'srh_heads.safetensors'})" in result.output
    assert f"layer_budgets: will compile ({store_folder(model) / 'layer_budgets.safetensors'})" in result.output
    result = runner.invoke(app, ["compile", "--model", model, "--methods", "compresskv,kvcompose"])
    job = ["--model", model, "--resume", "--device", "cpu", "--dtype", "float32"]
    assert result.exit_code == 0 and ran == [["layer-errors", *job], ["stats", *job]], result.output
    base = saved(tiny_model("llama", seed=2), tmp_path / "base")  # no chat template: heads probes it in raw text
    ran.clear()
    result = runner.invoke(app, ["compile", "--model", base, "--methods", "srh"])
    assert result.exit_code == 0 and ran == [["heads", "--model", base, "--resume", "--prompt-format", "raw",
                                              "--device", "cpu", "--dtype", "float32"]], result.output  # fmt: skip
    result = runner.invoke(app, ["compile", "--model", model, "--methods", "compresskv,nothing"])
    assert result.exit_code == 2 and "unknown method 'nothing'" in result.output


def test_generate_without_a_tuned_default_says_which_method_serves_and_loads_in_the_dtype_asked(
    shipped, tmp_path, prompt, monkeypatch
):
    model = saved(tiny_model("llama"), tmp_path / "m")
    dtypes = []
    load = model_loading._load_folder
    monkeypatch.setattr(
        model_loading, "_load_folder", lambda folder, dtype: dtypes.append(dtype) or load(folder, dtype)
    )
    args = ["generate", "--model", model, "--prompt-file", prompt, "--max-new-tokens", "2", "--dtype", "bfloat16"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "note: no tuned_defaults for this model (`kvcompile tune`); using kvcompress" in result.output
    assert "compression report: kvcompress, ratio 0.5" in result.output and dtypes == [torch.bfloat16]
    result = runner.invoke(app, [*args[:-1], "float8"])
    assert result.exit_code == 2 and "--dtype 'float8': use one of float32, bfloat16, float16" in result.output


COSTS = ForwardCosts(
    prefill_per_token=(1e-3, 1e-6), second_pass_per_token=(2e-3, 2e-6), decode=0.05, scored=4e-3, query_step=0.3
)


def test_each_compile_commands_estimate_adds_up_its_forwards():
    shape = model_fingerprint(tiny_model("llama"))  # 4 layers, 4 query heads, 2 KV heads

    def prefill(tokens: int) -> float:
        return tokens * (1e-3 + 1e-6 * tokens)

    def second(tokens: int) -> float:
        return tokens * (2e-3 + 2e-6 * tokens)

    heads = 11 * 3 * sum(prefill(n) + 30 * 0.05 for n in (512, 1024, 1536, 2048))
    assert HeadsSettings().estimated_seconds(COSTS, shape) == pytest.approx(heads)
    assert LayerErrorsSettings().estimated_seconds(COSTS, shape) == pytest.approx(24 * (prefill(1024) + 32 * 0.05))
    assert StatsSettings().estimated_seconds(COSTS, shape) == pytest.approx(24 * (prefill(2048) + second(2048)))
    lookahead = 16 * (prefill(1024) + second(1024)) + 400 * 0.3  # 12 contexts trained, 4 held out, 400 steps
    distill = 32 * (prefill(2048) + second(2048)) + lookahead
    assert DistillSettings().estimated_seconds(COSTS, shape) == pytest.approx(distill)
    # every-state: 4 layers x 4 query heads at weight 1.5 (1.0 repeats the base), 4 layers x 3 thresholds, the base
    # and the full cache's continuation (the KL); the greedy continuation decoded once per chosen prompt
    per_unit = 1 + 1 + 4 * 4 + 4 * 3
    chosen = 2 * prefill(2048) + 128 * 4e-3 + 128 * 0.05
    tables = 64 * prefill(2048) + 16 * chosen + 16 * per_unit * 127 * 4e-3 + 2 * 15
    assert TablesSettings().estimated_seconds(COSTS, shape) == pytest.approx(tables)
    # the paper's shape, sampled: 2 (layer, KV group) pairs x 2 query heads x 8 weights, 4 layers x 7 thresholds
    paper = TablesSettings(
        design=DESIGNS["sampled"], loss="nll", continuation_from="corpus", budgets=(256, 512), prompts=32, rounds=2
    )
    per_unit = 1 + 2 * 2 * 8 + 4 * 7
    tables = 64 * prefill(2048) + 32 * (prefill(2048) + 128 * 4e-3) + 2 * 32 * 2 * per_unit * 127 * 4e-3 + 4 * 15
    assert paper.estimated_seconds(COSTS, shape) == pytest.approx(tables)


def read_back(settings_type: type, given: dict[str, str | bool]) -> object:
    """The settings a command line with the flags `given` (each at its text) reads as: the others at their
    defaults."""
    kinds = typing.get_type_hints(settings_type)
    fields = {flag_of(field): field for field in command_line_fields(settings_type)}
    values = {field.name: command_line_default(field, kinds[field.name]) for field in fields.values()}
    for flag, text in given.items():
        field = fields[flag]
        values[field.name] = command_line_kind(field, kinds[field.name])(text)
    return settings_from_command_line(settings_type, values)


def test_the_probe_times_every_forward_on_a_real_model():
    costs = measure_forward_costs(tiny_model("gemma3_text"))  # sliding layers, the maxima of the growing ones
    assert all(value > 0 for value in (costs.prefill(512), costs.second_pass(512), costs.decode, costs.scored))
    assert costs.query_step > 0 and costs.prefill_per_token[1] >= 0 and costs.second_pass_per_token[1] >= 0


def test_compile_says_what_each_command_would_take_before_it_starts(shipped, tmp_path, monkeypatch):
    model = saved(tiny_model("llama", seed=2), tmp_path / "m")
    monkeypatch.setattr("kvcompile.recipes.forward_probe.measure_forward_costs", lambda loaded: COSTS)
    result = runner.invoke(app, ["compile", "--model", model, "--methods", "compresskv", "--dry-run"])
    shape = model_fingerprint(tiny_model("llama", seed=2))
    heads = HeadsSettings(chat=False).estimated_seconds(COSTS, shape)  # no chat template: raw probes
    errors = LayerErrorsSettings().estimated_seconds(COSTS, shape)
    assert result.exit_code == 0, result.output
    assert heads > 90 > errors  # minutes above a minute and a half, seconds below
    assert f"srh_heads: about {heads / 60:.0f} min" in result.output
    assert f"layer_budgets: about {errors:.0f} s" in result.output
    assert f"estimate: about {(heads + errors) / 60:.0f} min in all" in result.output


COMPILE_DEFAULTS = [HeadsSettings(), LayerErrorsSettings(), StatsSettings(), DistillSettings(), TablesSettings()]


@pytest.mark.parametrize("settings", COMPILE_DEFAULTS, ids=lambda settings: type(settings).__name__)
def test_scaled_settings_are_the_defaults_at_one_valid_below_and_cheaper_the_smaller(settings):
    shape = model_fingerprint(tiny_model("llama"))
    assert settings.scaled(1.0) == settings and command_line_arguments(settings.scaled(1.0)) == []
    seconds = [settings.scaled(scale).estimated_seconds(COSTS, shape) for scale in (0, 0.2, 0.4, 0.6, 0.8, 1)]
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1] / 2
    for scale in (0, 0.3, 0.7):
        settings.scaled(scale).check()


def test_the_least_settings_are_each_recipes_floor_and_a_half_halves_the_counts():
    assert HeadsSettings().scaled(0) == HeadsSettings(lengths=(512, 1024), depths=(0, 0.5, 1))
    assert HeadsSettings().scaled(0.5).depths == (0, 0.2, 0.4, 0.6, 0.8, 1)  # 11 x 0.5, rounded, both ends kept
    assert LayerErrorsSettings().scaled(0) == LayerErrorsSettings(prompts=6, new_tokens=8)
    assert LayerErrorsSettings().scaled(0.5) == LayerErrorsSettings(prompts=12, new_tokens=16)
    assert StatsSettings().scaled(0) == StatsSettings(prompts=6, prompt_tokens=512)
    assert StatsSettings().scaled(0.5) == StatsSettings(prompts=12, prompt_tokens=1024)
    least = DistillSettings(
        prompts=8, prompt_tokens=1024, lookahead_steps=100, lookahead_prompts=4, lookahead_held_out=2
    )
    assert DistillSettings().scaled(0) == least
    assert DistillSettings().scaled(0.3).prompts == 8 and DistillSettings().scaled(0.4).prompts == 12  # 4 x round(x)
    assert TablesSettings().scaled(0) == TablesSettings(prompts=8, candidates=16, continuation=32)
    assert TablesSettings().scaled(0.75) == TablesSettings(prompts=12, candidates=48, continuation=96)


def test_the_fitted_scale_is_the_largest_whose_estimate_fits():
    def seconds_at(scale: float) -> float:
        return 100 + 900 * scale

    assert (
        fitted_scale(seconds_at, 550) == pytest.approx(0.5, abs=0.01)
        and seconds_at(fitted_scale(seconds_at, 550)) <= 550
    )
    assert fitted_scale(seconds_at, 1000) == 1.0 and fitted_scale(seconds_at, 5000) == 1.0
    assert fitted_scale(seconds_at, 99) is None and fitted_scale(seconds_at, 100) == pytest.approx(0, abs=0.01)


def test_compile_fits_the_settings_into_minutes_and_a_rerun_resumes_them(shipped, tmp_path, monkeypatch):
    model = saved(tiny_model("llama", seed=2), tmp_path / "m")
    shape = model_fingerprint(tiny_model("llama", seed=2))
    kinds = [HeadsSettings(chat=False), LayerErrorsSettings()]  # compresskv's, raw probes (no chat template)

    def seconds(scale: float) -> float:
        return sum(settings.scaled(scale).estimated_seconds(COSTS, shape) for settings in kinds)

    probes, ran = [], []
    monkeypatch.setattr("kvcompile.recipes.forward_probe.measure_forward_costs", lambda m: probes.append(1) or COSTS)
    monkeypatch.setattr(
        subprocess, "run", lambda command, **_: ran.append(command[3:]) or subprocess.CompletedProcess(command, 0)
    )
    minutes = ESTIMATE_MARGIN * seconds(0.5) / 60  # the estimate times what compiles took over it, at most
    args = ["compile", "--model", model, "--methods", "compresskv", "--minutes", str(minutes)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads((store_folder(model) / "compile_plan.json").read_text())
    scale = plan["scale"]
    budget = minutes * 60 / ESTIMATE_MARGIN
    assert seconds(scale) <= budget < seconds(scale + 0.01) and 0.45 < scale < 0.55 and probes == [1]
    assert plan["estimated_seconds"]["srh_heads"] == pytest.approx(
        kinds[0].scaled(scale).estimated_seconds(COSTS, shape)
    )
    for command, settings in zip(ran, kinds, strict=True):
        flags = command_line_arguments(settings.scaled(scale))
        assert " ".join(flags) in " ".join(command) and f"({' '.join(flags)})" in result.output
    assert f"settings scaled by {scale:.2f} to fit --minutes {minutes:g}" in result.output
    first, ran[:] = list(ran), []
    result = runner.invoke(app, args)  # the commands' --resume refuses other settings: the same ones, unprobed
    assert result.exit_code == 0 and "resuming the settings chosen for --minutes" in result.output
    assert ran == first and probes == [1]
    least = ESTIMATE_MARGIN * seconds(0)
    result = runner.invoke(app, [*args[:-1], str(least / 60 - 0.01)])  # another budget: probed again
    assert result.exit_code == 2 and probes == [1, 1]
    said = f"the least settings would take up to {least:.0f} s here; give --minutes {math.ceil(least / 60)} or more"
    assert least < 90 and said in result.output
    result = runner.invoke(app, [*args[:-1], "0"])
    assert result.exit_code == 2 and "--minutes 0: give a positive number of minutes" in result.output
    assert probes == [1, 1] and len(ran) == 2


def test_the_flags_compile_passes_give_back_the_settings_a_recorded_command_names():
    """The inverse of the command line's parsing; and the shipped Gemma tables' recorded command names the tables'
    defaults (what `compile` runs), flag for flag."""
    recorded = json.loads((artifact_folder("gemma-3-270m") / "compilerkv_tables.run.json").read_text())
    flags = shlex.split(recorded["command_line"])[2:]
    given = dict(zip(flags[::2], flags[1::2]))
    given = {flag: value for flag, value in given.items() if flag not in ("--model", "--out")}
    assert len(given) == 8
    assert read_back(TablesSettings, given) == TablesSettings()
    paper = TablesSettings(
        design=DESIGNS["sampled"], loss="nll", continuation_from="corpus", budgets=(256, 512), prompts=32, rounds=2,
        entropy_bins=20, perplexity_bins=4,
    )  # fmt: skip
    arguments = command_line_arguments(paper)
    assert len(arguments) == 16 and read_back(TablesSettings, dict(zip(arguments[::2], arguments[1::2]))) == paper
    assert command_line_arguments(HeadsSettings(chat=False)) == ["--prompt-format", "raw"]
    assert "--elastic" in command_line_arguments(dataclasses.replace(paper, elastic=True))
    assert command_line_arguments(DistillSettings()) == []
