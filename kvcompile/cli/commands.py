"""The command line's application (`app`, `main`), its checks, `generate`, and the compile commands (then the recipe:
`kvcompile/recipe.py`). Every command's options are dataclass fields, each declared once by `kvcompile.settings.option`
(a recipe's settings, a command's inputs or options) and derived here (`settings_command`, `compile_command`).
`kvcompile.cli` adds the other commands.

Nothing heavy is imported before the options are checked: bad input is refused in one line before torch loads."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import shlex
import signal
import sys
import typing
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcompile import recipe
from kvcompile.cli.generation import GenerateOptions
from kvcompile.recipe import compile_artifact, default_artifact
from kvcompile.recipes.compilerkv.settings import TablesSettings
from kvcompile.recipes.compresskv.settings import HeadsSettings, LayerErrorsSettings
from kvcompile.recipes.distilled.settings import DistillSettings
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvcompile.settings import (
    command_line_default,
    command_line_fields,
    command_line_kind,
    device_option,
    dtype_option,
    flag_of,
    model_option,
    option,
    settings_from_command_line,
)
from kvruntime import KVRuntimeError
from kvruntime.registry import methods_help

app = typer.Typer(
    help="Compile KV-cache compression artifacts for a model, and run compressed generation. "
    f"Runtime methods: {methods_help()}.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@contextlib.contextmanager
def clear_errors() -> Iterator[contextlib.ExitStack]:
    """Bad input ends the command with one line naming the problem and a non-zero exit, no traceback; an
    interrupted one with "aborted" (130). Yields the command's resources (output locks), released when it ends."""
    try:
        with contextlib.ExitStack() as resources:
            yield resources
    except KVRuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:  # a file that vanished or could not be read or written mid-run
        where = f" ({exc.filename})" if exc.filename else ""
        typer.echo(f"error: {exc.strerror or exc}{where}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`main`): the resources above are released by now
        typer.echo("aborted", err=True)
        raise typer.Exit(130) from None


try:  # the click typer runs on: its own copy in newer typers, the click package in older ones
    from typer._click import exceptions as _CLICK
except ImportError:
    from click import exceptions as _CLICK
_NO_ARGS_IS_HELP = getattr(_CLICK, "NoArgsIsHelpError", ())  # click >= 8.2; older ones print the help themselves


def _terminated(signum: int, frame: object) -> None:
    # A run ended by `kill` or `timeout` unwinds as Ctrl-C does: its locks and staging files are released.
    raise KeyboardInterrupt


def main() -> None:
    """The `kvcompile` command: a usage error (an option of the wrong type, a missing option, an unknown command)
    is one line and exit code 2, like every other refusal; Ctrl-C and SIGTERM end it with "aborted" (130)."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = app(standalone_mode=False)
    except _NO_ARGS_IS_HELP as exc:
        typer.echo(exc.ctx.get_help())
        code = 0
    except _CLICK.UsageError as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        code = 2
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("aborted", err=True)
        code = 130
    sys.exit(code or 0)


def settings_options(settings_type: type | None) -> list[inspect.Parameter]:
    """The command-line options of a settings dataclass: one per field made by `kvcompile.settings.option`, its type
    the field's (text for a choice's name or comma-separated values), its default and help the field's."""
    if settings_type is None:
        return []
    kinds = typing.get_type_hints(settings_type)
    options = []
    for field in command_line_fields(settings_type):
        default = command_line_default(field, kinds[field.name])
        old = field.metadata["old_flags"]
        # No names given: typer's own (`--x/--no-x` for a bool).
        names = [flag_of(field), *old] if field.metadata["flag"] or old else []
        given = (
            typer.Argument(help=field.metadata["help"])
            if field.metadata["argument"]
            else typer.Option(*names, help=field.metadata["help"])
        )
        hint = Annotated[command_line_kind(field, kinds[field.name]), given]
        default = inspect.Parameter.empty if default is dataclasses.MISSING else default
        options.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint))
    return options


def settings_command(settings_type: type, name: str | None = None) -> Callable:
    """Register a command whose options are all `settings_type`'s fields (`settings_options`). The decorated function
    takes the settings the options make (`settings_from_command_line`), the click context and the command's
    resources (`clear_errors`); bad input ends it in one line."""
    options = settings_options(settings_type)

    def register(run: Callable) -> Callable:
        def command(ctx: typer.Context, **given: object) -> None:
            with clear_errors() as resources:
                run(settings_from_command_line(settings_type, given), ctx, resources)

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = inspect.Signature([context, *options])
        command.__name__, command.__doc__ = run.__name__, run.__doc__
        app.command(name)(command)
        return run

    return register


@settings_command(GenerateOptions)
def generate(options: GenerateOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Generate from prompt files with a compressed KV cache, then print the compression report (per batch of
    several prompts: each row's and the batch's bytes held). A prompt is the user's turn of the model's chat
    template (`--prompt-format auto`, for instruct models) or raw text."""
    from kvcompile.cli.generation import check_generation_inputs, compression_asked, generate_compressed, read_prompts
    from kvruntime.registry import SAVED_CONTEXT_METHOD
    from kvruntime.requests.request import parse_option_pairs

    if options.context is not None:
        from kvcompile.cli.saved_contexts import answer_from_context, checked_context

        answer_from_context(*checked_context(options), options, typer.echo)
        return
    if not options.prompt_file:
        raise KVRuntimeError("give --prompt-file (the prompt, or the document with --question), or --context FILE")
    if options.save_context is not None and options.method is None and not options.artifact:
        options = dataclasses.replace(options, method=SAVED_CONTEXT_METHOD)
    prompts = read_prompts(options.prompt_file)
    positions = check_generation_inputs(prompts, options)
    asked = compression_asked(options, parse_option_pairs(options.option or [], options.method), positions)
    if asked.note:
        typer.echo(f"note: {asked.note}", err=True)
    generate_compressed(asked, prompts, options, typer.echo)


CORPUS_HELP = (
    "Calibration text: 'austen' (shipped, default), 'austen-repeats' (with repeating text; distill's default), "
    "'austen-facts' (austen-repeats with figures, names and codes inside the novels' text), 'austen-records' (the "
    "same, the facts in runs of four of one template), 'mixed' (austen-repeats with shipped code, documentation and "
    "math text), a .txt/.txt.gz file or folder, a jsonl/parquet."
)


def job_options(kind: str, shardable: bool, checkpoint_every: int) -> type:
    """The options every compile command shares (`compile_artifact`'s job), as a dataclass: --model, --out (its
    artifact's default path), --resume, for recipes that split their work --shard and --checkpoint-every, --device,
    --dtype."""
    fields = [
        ("model", str, model_option()),
        (
            "out",
            Path | None,
            option(
                None,
                f"Output artifact (default: the store, $KVCOMPILE_CACHE/artifacts/<model>/{kind}.safetensors; the "
                "shipped artifacts/ are never written).",
            ),
        ),
        ("resume", bool, option(False, "Continue an interrupted run of the same settings.")),
    ]
    if shardable:
        shard = option(
            None,
            "i/n: do share i of n, counted from 0 (0/2 and 1/2), as a separate job and write partial statistics for "
            "`kvcompile merge` (under torchrun every rank takes its share without this).",
        )
        checkpoint = option(checkpoint_every, "Save the partial statistics after this many items (probes or prompts).")
        fields += [("shard", str | None, shard), ("checkpoint_every", int, checkpoint)]
    fields += [
        ("device", str, device_option()),
        ("dtype", str, dtype_option()),
    ]
    return dataclasses.make_dataclass("JobOptions", fields, frozen=True)


# The commands that write an artifact (what `reproduce` may run), each with its inputs that read a file or folder.
COMPILE_COMMANDS: dict[str, frozenset[str]] = {}
COMPILE_SETTINGS: dict[str, type] = {}  # each artifact kind's compile settings (`compile` estimates their time)


def _reads_path(kind: object) -> bool:
    """Whether an option of type `kind` (`Path | None`) takes a path."""
    return kind is Path or Path in typing.get_args(kind)


def compile_command(
    kind: str,
    settings: type | None,
    inputs: type,
    shardable: bool = False,
    checkpoint_every: int = 4,
    old_names: tuple[str, ...] = (),
) -> Callable:
    """Register a compile command. Its options are three dataclasses' fields, each declared once: `inputs` (what
    the recipe reads: a corpus, another artifact; tune's own options), `settings` (the recipe's settings, recorded in
    its artifact) and the job's (`job_options`). The function takes the inputs, and `model`, `out` or the click
    context `ctx` if it names them, and returns the recipe, or (recipe, settings) for a command without `settings`;
    the command runs `compile_artifact`, refusing bad input in one line. `old_names`: the command's names before a
    rename, kept hidden: the commands recorded in artifacts name them, and `reproduce` reruns those."""
    job_type = job_options(kind, shardable, checkpoint_every)
    if settings is not None:
        COMPILE_SETTINGS[kind] = settings
    parts = {"inputs": inputs, "settings": settings, "job": job_type}
    options = {part: settings_options(declared) for part, declared in parts.items()}

    def register(build: Callable) -> Callable:
        wanted = inspect.signature(build).parameters

        def command(ctx: typer.Context, **params: object) -> None:
            given = {part: {o.name: params[o.name] for o in declared} for part, declared in options.items()}
            with clear_errors() as resources:
                job = dataclasses.asdict(settings_from_command_line(job_type, given["job"]))
                known = {"ctx": ctx, "inputs": settings_from_command_line(inputs, given["inputs"]), **job}
                built = build(**{name: value for name, value in known.items() if name in wanted})
                recipe_, settings_ = (
                    built if settings is None else (built, settings_from_command_line(settings, given["settings"]))
                )
                rerun = command_line(ctx, leave_out=recipe.OUTPUT_OPTIONS)
                compile_artifact(recipe_, settings_, resources=resources, echo=typer.echo, command=rerun, **job)

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = inspect.Signature([context, *options["inputs"], *options["settings"], *options["job"]])
        command.__name__, command.__doc__ = build.__name__, build.__doc__
        kinds = typing.get_type_hints(inputs)
        reads = frozenset(f.name for f in command_line_fields(inputs) if _reads_path(kinds[f.name]))
        for name in (build.__name__.replace("_", "-"), *old_names):
            app.command(name, hidden=name in old_names)(command)
            COMPILE_COMMANDS[name] = reads
        return build

    return register


def corpus_option() -> Any:
    return option(None, CORPUS_HELP)


@dataclasses.dataclass(frozen=True)
class CorpusInputs:
    corpus: str | None = corpus_option()


@compile_command("srh_heads", HeadsSettings, CorpusInputs, shardable=True, checkpoint_every=8)
def heads(inputs: CorpusInputs) -> object:
    """Score every query head as a Semantic Retrieval Head (and a classic retrieval head) on needle probes."""
    from kvcompile.recipes.compresskv.recipe import HeadsRecipe

    return HeadsRecipe(inputs.corpus)


@dataclasses.dataclass(frozen=True)
class LayerErrorsInputs:
    heads_artifact: Path | None = option(
        None, "srh_heads artifact (default: the model's compiled one, else its shipped one).", flag="--heads"
    )
    corpus: str | None = corpus_option()


@compile_command("layer_budgets", LayerErrorsSettings, LayerErrorsInputs, shardable=True, old_names=("budgets",))
def layer_errors(inputs: LayerErrorsInputs, model: str) -> object:
    """Measure each layer's compression error and write the inputs of the error-aware layer budgets."""
    from kvcompile.recipes.compresskv.recipe import LayerErrorsRecipe

    return LayerErrorsRecipe(inputs.corpus, inputs.heads_artifact or default_artifact(model, "srh_heads"))


@dataclasses.dataclass(frozen=True)
class TablesInputs:
    corpus: str | None = corpus_option()
    from_experience: Path | None = option(
        None, "Relearn the tables from a stored compilerkv_experience artifact (no rollouts)."
    )


@compile_command("compilerkv_tables", TablesSettings, TablesInputs)
def tables(inputs: TablesInputs) -> object:
    """Learn CompilerKV's head-reliability and risk-threshold tables (offline contextual bandits, DiscreteCQL)."""
    from kvcompile.recipes.compilerkv.recipe import TablesRecipe

    return TablesRecipe(inputs.corpus, inputs.from_experience)


@dataclasses.dataclass(frozen=True)
class StatsInputs:
    corpus: str | None = corpus_option()
    task_set: Path | None = option(
        None, "Task-aware mode: a text file of downstream prompts, one per line (default: task-agnostic)."
    )


@compile_command("kvcompose_stats", StatsSettings, StatsInputs, shardable=True)
def stats(inputs: StatsInputs) -> object:
    """Measure KVCompose's attention statistics: composite-token curves and the layer allocation per ratio."""
    from kvcompile.recipes.kvcompose.recipe import StatsRecipe

    return StatsRecipe(inputs.corpus, inputs.task_set)


@compile_command("distilled_scorer", DistillSettings, CorpusInputs, shardable=True)
def distill(inputs: CorpusInputs) -> object:
    """Distil a one-pass token scorer from a second pass over calibration prompts (ridge regression per layer)."""
    from kvcompile.calibration.corpus import REPEATING_CORPUS
    from kvcompile.recipes.distilled.recipe import DistillRecipe

    return DistillRecipe(inputs.corpus or REPEATING_CORPUS)


def command_line(ctx: typer.Context, leave_out: Collection[str] = ()) -> str:
    """The command with every setting spelled out (defaults included, the options named in `leave_out` left out):
    what reruns it, recorded in the reports and artifacts it writes."""
    parts = ["kvcompile", ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in leave_out or value is None:
            continue
        if isinstance(value, bool):
            flags = param.opts if value else param.secondary_opts
            parts += flags[:1]
        else:
            parts += [param.opts[0], str(value)]
    return shlex.join(parts)
