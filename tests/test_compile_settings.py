"""A compile command's options are its recipe's settings dataclass (`kvcompile.settings`): declared there once,
derived into the command line, read back into the settings the recipe runs with."""

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from kvcompile.cli import app, commands
from kvcompile.recipes.compilerkv.settings import DESIGNS, TablesSettings
from kvcompile.recipes.compresskv.settings import BudgetsSettings, HeadsSettings
from kvcompile.recipes.distilled.settings import DistillSettings
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvcompile.settings import Settings, command_line_fields, option, settings_from_command_line
from kvruntime import KVRuntimeError

runner = CliRunner()

SETTINGS_OF = {
    "heads": HeadsSettings,
    "budgets": BudgetsSettings,
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
        assert params[field.name].opts == [flag] and params[field.name].help == field.metadata["help"]
    shared = {"model", "out", "resume", "shard", "checkpoint_every", "device", "dtype"}
    inputs = {"corpus", "heads_artifact", "from_experience", "task_set"}  # the recipes' inputs, not settings
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
        (["budgets", "--new-tokens", "4"], BudgetsSettings(new_tokens=4)),
    ],
)
def test_a_compile_command_runs_its_recipe_with_the_settings_it_was_given(monkeypatch, args, expected):
    ran = {}
    monkeypatch.setattr(commands, "compile_artifact", lambda recipe, settings, **job: ran.update(settings=settings))
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ran["settings"] == expected
