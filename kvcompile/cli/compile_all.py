"""`kvcompile compile`: every artifact some methods need, for one model, in one command: the compile commands
their artifacts name (`kvruntime.ARTIFACT_KINDS`), in the order one reads another's (heads before layer-errors),
each run as its own `kvcompile <command> --model X --resume` (its artifact records that command, which reruns it),
an artifact the model already has (compiled here or shipped for the same weights) left as it is."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvcompile.cli.commands import COMPILE_SETTINGS, settings_command
from kvcompile.cli.compile_plan import (
    ALL_METHODS,
    ESTIMATE_MARGIN,
    compile_arguments,
    fitted_scale,
    kinds_needed,
    methods_of,
)
from kvcompile.settings import device_option, dtype_option, model_option, option

if TYPE_CHECKING:
    from kvcompile.calibration.forward_costs import ForwardCosts
    from kvruntime.artifacts.fingerprint import ModelFingerprint


# In the model's store: the scale the commands run at (a rerun under the same --minutes resumes it) and their
# estimates.
PLAN_FILE = "compile_plan.json"


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    model: str = model_option()
    methods: str = option(
        ALL_METHODS,
        "The methods to compile for, comma-separated (e.g. compresskv,distilled); 'all': every method that reads "
        "an artifact.",
    )
    minutes: float | None = option(
        None,
        "Fit the compile into about this many minutes here: every command's sample counts scaled down by one factor, "
        "none below its floor (docs/compile-for-your-model.md says what each trades). Default: the commands' "
        "defaults.",
    )
    dry_run: bool = option(False, "Say what would be compiled, where, and how long it would take, then stop.")
    device: str = device_option()
    dtype: str = dtype_option()


@settings_command(CompileOptions, name="compile")
def compile_model(options: CompileOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Compile every artifact the methods need for the model, one compile command after another (each resumable;
    heads in raw text for a model without a chat template); what the model has is kept."""
    from kvcompile.recipe import check_device_name, check_dtype_name, default_artifact
    from kvruntime import KVRuntimeError
    from kvruntime.models.model_spec import check_model_spec, model_facts

    methods = methods_of(options.methods)
    kinds = kinds_needed(methods)
    check_model_spec(options.model)
    check_device_name(options.device)
    check_dtype_name(options.dtype)
    if options.minutes is not None and not options.minutes > 0:
        raise KVRuntimeError(f"--minutes {options.minutes:g}: give a positive number of minutes")
    have = {kind: default_artifact(options.model, kind) for kind in kinds}
    missing = [kind for kind in kinds if not have[kind].exists()]
    for kind in kinds:
        state = "have" if have[kind].exists() else "will compile"
        typer.echo(f"{kind}: {state} ({have[kind]})", err=True)
    if not missing:
        typer.echo("nothing to compile", err=True)
        return
    chat = model_facts(options.model).chat
    scale = planned_scale(options, missing, chat)
    if options.dry_run:
        typer.echo(f"would run {len(missing)} compile commands", err=True)
        return
    for number, kind in enumerate(missing, 1):
        command = compile_arguments(
            kind, options.model, compile_settings(kind, chat, scale), options.device, options.dtype
        )
        typer.echo(f"[{number}/{len(missing)}] kvcompile {' '.join(command)}", err=True)
        done = subprocess.run([sys.executable, "-m", "kvcompile.cli", *command])
        if done.returncode != 0:
            raise typer.Exit(done.returncode)
    typer.echo(f"compiled {', '.join(missing)} for {options.model}", err=True)


def compile_settings(kind: str, chat: bool | None, scale: float = 1.0) -> object:
    """The settings `compile` runs `kind`'s command at: its defaults (scaled down by `scale` below 1), but heads in
    raw text for a model without a chat template (its default, the template, would be refused there)."""
    settings = COMPILE_SETTINGS[kind]()
    if kind == "srh_heads" and chat is False:
        settings = dataclasses.replace(settings, chat=False)
    return settings.scaled(scale) if scale < 1 else settings


@dataclasses.dataclass(frozen=True)
class CompileEstimate:
    """What the compile commands of `kinds` would take on a model whose forwards cost `costs` (`compile_settings`'
    `estimated_seconds`), at any scale of their settings."""

    kinds: tuple[str, ...]
    chat: bool | None
    costs: ForwardCosts
    model: ModelFingerprint

    def seconds(self, scale: float = 1.0) -> dict[str, float]:
        return {
            kind: compile_settings(kind, self.chat, scale).estimated_seconds(self.costs, self.model)
            for kind in self.kinds
        }

    def scale_within(self, minutes: float) -> float | None:
        """The largest scale whose estimate, times what compiles took over theirs at most, fits in `minutes`."""
        return fitted_scale(lambda scale: ESTIMATE_MARGIN * sum(self.seconds(scale).values()), minutes * 60)


def planned_scale(options: CompileOptions, kinds: list[str], chat: bool | None) -> float:
    """The scale the commands run at (1: their defaults), after saying what each would take: under --minutes, the
    largest that fits, chosen once and kept in the model's store with the estimates, so that a rerun resumes the
    same settings (the commands' --resume refuses others)."""
    from kvcompile.recipe import store_folder
    from kvruntime import KVRuntimeError
    from kvruntime.files import write_atomically

    plan = store_folder(options.model) / PLAN_FILE
    if options.minutes is not None and (saved := saved_scale(plan, options.minutes)) is not None:
        typer.echo(f"resuming the settings chosen for --minutes {options.minutes:g} ({plan})", err=True)
        return saved
    estimate = CompileEstimate(tuple(kinds), chat, *_forward_costs(options))
    scale = 1.0
    if options.minutes is not None:
        fitted = estimate.scale_within(options.minutes)
        if fitted is None:
            least = ESTIMATE_MARGIN * sum(estimate.seconds(0.0).values())
            raise KVRuntimeError(
                f"--minutes {options.minutes:g}: the least settings would take up to {_duration(least)} here; give "
                f"--minutes {math.ceil(least / 60)} or more"
            )
        scale = fitted
    estimates = estimate.seconds(scale)
    if not options.dry_run:
        chosen = json.dumps({"minutes": options.minutes, "scale": scale, "estimated_seconds": estimates})
        write_atomically(plan, lambda name: Path(name).write_text(chosen))
    typer.echo(estimate_lines(options, estimates, chat, scale), err=True)
    return scale


def saved_scale(plan: Path, minutes: float) -> float | None:
    """The scale an earlier run chose for the same --minutes (None: none, another budget, or not a plan)."""
    try:
        saved = json.loads(plan.read_text())
        scale = saved["scale"] if saved["minutes"] == minutes else None
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return scale if isinstance(scale, float) and 0 <= scale <= 1 else None


def _forward_costs(options: CompileOptions) -> tuple[ForwardCosts, ModelFingerprint]:
    """The model's forwards timed once here (`measure_forward_costs`; the model loaded as the commands load it)."""
    from kvcompile import recipe
    from kvcompile.recipes.forward_probe import measure_forward_costs
    from kvruntime import model_fingerprint

    typer.echo("timing the model's forwards for an estimate ...", err=True)
    loaded, _ = recipe.load_model(options.model, device=options.device, dtype=options.dtype)
    return measure_forward_costs(loaded), model_fingerprint(loaded)


def estimate_lines(options: CompileOptions, seconds: dict[str, float], chat: bool | None, scale: float) -> str:
    """What each compile command would take (at which settings, when scaled), and what the model cache holds on
    disk."""
    from kvcompile.settings import command_line_arguments
    from kvruntime.files import folder_bytes
    from kvruntime.models.model_loading import weights_folder

    lines = []
    for kind, kind_seconds in seconds.items():
        settings = " ".join(command_line_arguments(compile_settings(kind, chat, scale))) if scale < 1 else ""
        lines.append(f"  {kind}: about {_duration(kind_seconds)}" + (f" ({settings})" if settings else ""))
    folder = weights_folder(options.model)
    held = folder_bytes(folder) if folder is not None else 0
    fit = f", settings scaled by {scale:.2f} to fit --minutes {options.minutes:g}" if scale < 1 else ""
    lines.append(
        f"estimate: about {_duration(sum(seconds.values()))} in all{fit} (whole compiles took 1.0-1.24x their "
        f"estimates, single commands 0.8-1.45x; --minutes allows {ESTIMATE_MARGIN}x); disk: the model's weights, "
        f"{held / 1e9:.2f} GB in {folder}, and artifacts of a few MB"
    )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
