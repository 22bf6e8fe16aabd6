"""`kvcompile compile`: every artifact some methods need, for one model, in one command: the compile commands
their artifacts name (`kvruntime.ARTIFACT_KINDS`), in the order one reads another's (heads before layer-errors),
each run as its own `kvcompile <command> --model X --resume` (its artifact records that command, which reruns it),
an artifact the model already has (compiled here or shipped for the same weights) left as it is."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys

import typer

from kvcompile.cli.commands import COMPILE_SETTINGS, settings_command
from kvcompile.cli.compile_plan import ALL_METHODS, compile_arguments, kinds_needed, methods_of
from kvcompile.settings import device_option, dtype_option, model_option, option


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    model: str = model_option()
    methods: str = option(
        ALL_METHODS,
        "The methods to compile for, comma-separated (e.g. compresskv,distilled); 'all': every method that reads "
        "an artifact.",
    )
    dry_run: bool = option(False, "Say what would be compiled, where, and how long it would take, then stop.")
    device: str = device_option()
    dtype: str = dtype_option()


@settings_command(CompileOptions, name="compile")
def compile_model(options: CompileOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Compile every artifact the methods need for the model, one compile command after another (each resumable,
    at its default settings; heads in raw text for a model without a chat template); what the model has is kept."""
    from kvcompile.recipe import check_device_name, check_dtype_name, default_artifact
    from kvruntime.models.model_spec import check_model_spec, model_facts

    methods = methods_of(options.methods)
    kinds = kinds_needed(methods)
    check_model_spec(options.model)
    check_device_name(options.device)
    check_dtype_name(options.dtype)
    have = {kind: default_artifact(options.model, kind) for kind in kinds}
    missing = [kind for kind in kinds if not have[kind].exists()]
    for kind in kinds:
        state = "have" if have[kind].exists() else "will compile"
        typer.echo(f"{kind}: {state} ({have[kind]})", err=True)
    if not missing:
        typer.echo("nothing to compile", err=True)
        return
    chat = model_facts(options.model).chat
    typer.echo(estimate_lines(options, missing, chat), err=True)
    if options.dry_run:
        typer.echo(f"would run {len(missing)} compile commands", err=True)
        return
    for number, kind in enumerate(missing, 1):
        command = compile_arguments(kind, options.model, compile_settings(kind, chat), options.device, options.dtype)
        typer.echo(f"[{number}/{len(missing)}] kvcompile {' '.join(command)}", err=True)
        done = subprocess.run([sys.executable, "-m", "kvcompile.cli", *command])
        if done.returncode != 0:
            raise typer.Exit(done.returncode)
    typer.echo(f"compiled {', '.join(missing)} for {options.model}", err=True)


def compile_settings(kind: str, chat: bool | None) -> object:
    """The settings `compile` runs `kind`'s command at: its defaults, but heads in raw text for a model without a
    chat template (its default, the template, would be refused there)."""
    settings = COMPILE_SETTINGS[kind]()
    return dataclasses.replace(settings, chat=False) if kind == "srh_heads" and chat is False else settings


def estimate_lines(options: CompileOptions, kinds: list[str], chat: bool | None) -> str:
    """What each compile command would take, from the model's forwards timed once here (`measure_forward_costs`;
    the model loaded as the commands load it), and what the model cache holds on disk."""
    from kvcompile import recipe
    from kvcompile.calibration.forward_probe import measure_forward_costs
    from kvruntime import model_fingerprint
    from kvruntime.models.model_loading import weights_folder

    typer.echo("timing the model's forwards for an estimate ...", err=True)
    loaded, _ = recipe.load_model(options.model, device=options.device, dtype=options.dtype)
    costs, identity = measure_forward_costs(loaded), model_fingerprint(loaded)
    del loaded
    seconds = {kind: compile_settings(kind, chat).estimated_seconds(costs, identity) for kind in kinds}
    lines = [f"  {kind}: about {_duration(seconds[kind])}" for kind in kinds]
    folder = weights_folder(options.model)
    held = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder is not None else 0
    lines.append(
        f"estimate: about {_duration(sum(seconds.values()))} in all (the shipped models' five compiles took 1.0-1.1x "
        f"their estimates, single commands 0.85-1.3x); disk: the model's weights, {held / 1e9:.2f} GB in {folder}, "
        "and artifacts of a few MB"
    )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
