"""A command's options are a settings dataclass (`kvcompile.settings`): a compile command's, its recipe's settings;
`generate`'s, `eval`'s and `tune`'s, their options dataclasses. Declared there once, derived into the command line,
read back into the settings the command runs with."""

import dataclasses
import typing

import pytest
import typer
from typer.testing import CliRunner

from kvcompile.cli import app, commands
from kvcompile.cli.artifacts import BundleOptions, ExportKvzapOptions, InfoOptions, MergeOptions, ReproduceOptions
from kvcompile.cli.commands import CorpusInputs, LayerErrorsInputs, StatsInputs, TablesInputs
from kvcompile.cli.evaluation import EvalOptions, TuneOptions
from kvcompile.cli.generation import GenerateOptions
from kvcompile.recipes.compilerkv.settings import DESIGNS, TablesSettings
from kvcompile.recipes.compresskv.settings import HeadsSettings, LayerErrorsSettings
from kvcompile.recipes.distilled.settings import DistillSettings
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvcompile.settings import (
    Settings,
    command_line_default,
    command_line_fields,
    option,
    settings_from_command_line,
)
from kvruntime import KVRuntimeError

runner = CliRunner()

INPUTS_OF = {
    "heads": CorpusInputs,
    "layer-errors": LayerErrorsInputs,
    "tables": TablesInputs,
    "stats": StatsInputs,
    "distill": CorpusInputs,
}
SETTINGS_OF = {
    "heads": HeadsSettings,
    "layer-errors": LayerErrorsSettings,
    "tables": TablesSettings,
    "stats": StatsSettings,
    "distill": DistillSettings,
}


@dataclasses.dataclass(frozen=True)
class ToySettings(Settings):
    sizes: tuple[int, ...] = option((8, 16), "Sizes.")
    mode: str = option("fast", "How.", choices=("fast", "slow"))
    chat: bool = option(True, "Framing.", choices={"chat": True, "raw": False}, flag="--prompt-format")
    hidden: float = 0.5  # not on the command line


def test_a_field_declared_once_is_an_option_read_back_into_the_settings():
    options = {p.name: p for p in commands.settings_options(ToySettings)}
    assert list(options) == ["sizes", "mode", "chat"]
    assert [options[n].default for n in options] == ["8,16", "fast", "chat"]
    assert options["mode"].annotation.__metadata__[0].help == "How."
    read = settings_from_command_line(ToySettings, {"sizes": "4, 32", "mode": "slow", "chat": "raw"})
    assert read == ToySettings(sizes=(4, 32), mode="slow", chat=False, hidden=0.5)
    with pytest.raises(KVRuntimeError, match="--prompt-format 'xml': use one of chat, raw"):
        settings_from_command_line(ToySettings, {"sizes": "4", "mode": "slow", "chat": "xml"})
    with pytest.raises(KVRuntimeError, match="--mode 'medium': use one of fast, slow"):
        ToySettings(mode="medium").check()


@pytest.mark.parametrize("command", sorted(SETTINGS_OF))
def test_every_compile_commands_settings_are_its_options(command):
    """Each field made by `option` is an option of the command, with the field's help; the command has no other
    option beside the recipe's inputs and the job options every compile command shares."""
    settings = SETTINGS_OF[command]
    params = {p.name: p for p in typer.main.get_command(app).commands[command].params}
    fields = command_line_fields(settings)
    assert fields
    for field in fields:
        flag = field.metadata["flag"] or "--" + field.name.replace("_", "-")
        assert params[field.name].opts == [flag, *field.metadata["old_flags"]]
        assert params[field.name].help == field.metadata["help"]
    shared = {"model", "out", "resume", "shard", "checkpoint_every", "device", "dtype"}
    inputs = {f.name for f in command_line_fields(INPUTS_OF[command])}  # what the recipe reads, not settings
    assert set(params) - shared - inputs == {f.name for f in fields}


@pytest.mark.parametrize(
    "args, expected",
    [
        (["distill", "--prompts", "8", "--oracle", "repeat"], DistillSettings(prompts=8, oracle="repeat")),
        (["heads", "--lengths", "256,512", "--prompt-format", "raw"], HeadsSettings(lengths=(256, 512), chat=False)),
        (
            ["tables", "--design", "every-state", "--loss", "kl"],
            TablesSettings(design=DESIGNS["every-state"], loss="kl"),
        ),
        (["stats", "--ratios", "0.5,0.9", "--seed", "3"], StatsSettings(ratios=(0.5, 0.9), seed=3)),
        (["layer-errors", "--new-tokens", "4"], LayerErrorsSettings(new_tokens=4)),
        (["budgets", "--new-tokens", "4"], LayerErrorsSettings(new_tokens=4)),  # its name before issue #65
        (  # --context-tokens was --context before issue #65
            ["tables", "--context", "160", "--budgets", "80"],
            TablesSettings(context_tokens=160, budgets=(80,)),
        ),
    ],
)
def test_a_compile_command_runs_its_recipe_with_the_settings_it_was_given(monkeypatch, args, expected):
    ran = {}
    monkeypatch.setattr(
        commands, "compile_artifact", lambda recipe, settings, **job: ran.update(settings=settings, recipe=recipe)
    )
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ran["settings"] == expected
    assert type(ran["recipe"]).__name__ == f"{type(expected).__name__.removesuffix('Settings')}Recipe"


# What each command takes as its argument (`kvcompile info PATH`), the rest being options.
ARGUMENT_OF = {"merge": "partials", "info": "path", "bundle": "sources", "reproduce": "path", "export-kvzap": "path"}
OPTIONS_OF = {
    "generate": GenerateOptions,
    "eval": EvalOptions,
    "tune": TuneOptions,
    "merge": MergeOptions,
    "info": InfoOptions,
    "bundle": BundleOptions,
    "reproduce": ReproduceOptions,
    "export-kvzap": ExportKvzapOptions,
}


@pytest.mark.parametrize("command", sorted(OPTIONS_OF))
def test_every_other_commands_options_are_its_dataclasses_fields(command):
    """Every option and argument of the commands that compile nothing is a field of its dataclass, in its order, with
    its help and default (a flag's two names where it declares them); tune's are its own beside the job options of
    every compile command."""
    options = OPTIONS_OF[command]
    params = [p for p in typer.main.get_command(app).commands[command].params if p.name != "help"]
    fields = command_line_fields(options)
    shared = {"model", "out", "resume", "device", "dtype"} if command == "tune" else set()
    assert [p.name for p in params if p.name not in shared] == [f.name for f in fields]
    by_name = {p.name: p for p in params}
    kinds = typing.get_type_hints(options)
    for field in fields:
        param = by_name[field.name]
        assert param.help == field.metadata["help"]
        assert (param.param_type_name == "argument") == (field.name == ARGUMENT_OF.get(command))
        expected = command_line_default(field, kinds[field.name])
        assert param.required if expected is dataclasses.MISSING else param.default == expected
    if command == "eval":
        assert (by_name["shared_prefill"].opts, by_name["shared_prefill"].secondary_opts) == (
            ["--shared-prefill"],
            ["--own-prefills"],
        )


def test_generate_runs_with_the_options_it_was_given(tmp_path, monkeypatch):
    from kvcompile.cli import generation

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Some text to compress.")
    seen = {}

    def stop(settings, options, positions):
        seen.update(settings=settings, options=options)
        raise KVRuntimeError("stopped before the model loads")

    monkeypatch.setattr(generation, "compression_asked", stop)
    args = ["generate", "--prompt-file", str(prompt), "--method", "snapkv", "--ratio", "0.7", "--option", "window=8"]
    result = runner.invoke(app, [*args, "--force", "--batch-size", "2", "--question", "Why?"])
    assert result.exit_code == 2 and "stopped before the model loads" in result.output
    assert seen["settings"] == GenerateOptions(
        [prompt], method="snapkv", ratio=0.7, option=["window=8"], force=True, batch_size=2, question=["Why?"]
    )
    assert seen["options"] == {"window": 8}


def test_eval_and_tune_run_with_the_options_they_were_given(tmp_path, monkeypatch):
    from kvcompile.cli import evaluation

    seen = []

    def stop(options, ratios, new_tokens, positions):
        seen.append((options, ratios, new_tokens))
        raise KVRuntimeError("stopped before the model loads")

    monkeypatch.setattr(evaluation, "_suite_settings", stop)
    args = ["--ratios", "0.9,0.5", "--samples", "1", "--tasks", "passkey", "--question-aware"]
    assert runner.invoke(app, ["eval", *args, "--own-prefills", "--out", str(tmp_path / "e")]).exit_code == 2
    assert runner.invoke(app, ["tune", *args, "--tolerance", "0.05"]).exit_code == 2
    asked = dict(ratios=(0.9, 0.5), samples=1, tasks="passkey", question_aware=True)
    assert seen[0] == (EvalOptions(**asked, shared_prefill=False, out=tmp_path / "e"), (0.9, 0.5), 48)
    assert seen[1] == (TuneOptions(**asked, tolerance=0.05), (0.5, 0.9), 48)  # tune tries the ratios in order
