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

from kvcompile.cli.commands import settings_command
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
    dry_run: bool = option(False, "Say what would be compiled, and for which methods, then stop.")
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
    if not missing or options.dry_run:
        typer.echo("nothing to compile" if not missing else f"would run {len(missing)} compile commands", err=True)
        return
    chat = model_facts(options.model).chat
    for number, kind in enumerate(missing, 1):
        command = compile_arguments(kind, options.model, chat, options.device, options.dtype)
        typer.echo(f"[{number}/{len(missing)}] kvcompile {' '.join(command)}", err=True)
        done = subprocess.run([sys.executable, "-m", "kvcompile.cli", *command])
        if done.returncode != 0:
            raise typer.Exit(done.returncode)
    typer.echo(f"compiled {', '.join(missing)} for {options.model}", err=True)
