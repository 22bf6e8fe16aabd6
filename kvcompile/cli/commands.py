"""The command line's application (`app`, `main`), its shared options and checks, `generate`, and the compile
commands (their options derived from each recipe's settings dataclass, `kvcompile/settings.py`, then the recipe:
`kvcompile/recipe.py`). `kvcompile.cli` adds the other commands.

Nothing heavy is imported before the options are checked: bad input is refused in one line before torch loads."""

from __future__ import annotations

import contextlib
import inspect
import shlex
import signal
import sys
import typing
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Annotated

import typer

from kvcompile import recipe
from kvcompile.recipe import compile_artifact, default_artifact
from kvcompile.recipes.compilerkv.settings import TablesSettings
from kvcompile.recipes.compresskv.settings import BudgetsSettings, HeadsSettings
from kvcompile.recipes.distilled.settings import DistillSettings
from kvcompile.recipes.kvcompose.settings import StatsSettings
from kvcompile.settings import command_line_default, command_line_fields, settings_from_command_line
from kvruntime import KVRuntimeError
from kvruntime.registry import methods_help

app = typer.Typer(
    help="Compile KV-cache compression artifacts for a model, and run compressed generation. "
    f"Runtime methods: {methods_help()}.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelOption = Annotated[
    str,
    typer.Option(
        help="A shipped model: 'default' (SmolLM2-135M-Instruct) or 'gemma-3-270m' (Gemma 3 270M, base, hybrid); a "
        "GGUF file, a local model directory, or a cached hub id."
    ),
]
PromptFormatOption = Annotated[
    str,
    typer.Option(
        help="chat (the model's chat template), raw (base models), or auto (chat when the tokenizer has a template)."
    ),
]


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


GenerateMethodOption = Annotated[
    str | None,
    typer.Option(
        help=f"{methods_help()}. Default: the method and ratio of "
        "artifacts/<model>/tuned_defaults.safetensors (`kvcompile tune`) if there is one, else kvcompress."
    ),
]
QuestionOption = Annotated[
    list[str] | None,
    typer.Option(help="Question mode: compress the prompt without the question, then answer each --question."),
]
ArtifactOption = Annotated[
    list[Path] | None,
    typer.Option(
        help="Compiled artifact(s), or a bundle (its folder or hub repo id, from `kvcompile bundle`), checked "
        "against the model."
    ),
]
NearestBudgetOption = Annotated[
    bool,
    typer.Option(
        help="compilerkv: use the tables of the nearest compiled budget for a --budget not compiled (a --ratio always does)."
    ),
]
MethodOptionOption = Annotated[
    list[str] | None,
    typer.Option(help="A method option as key=value, e.g. mode=dynamic or unstructured=true for kvcompose."),
]
PrefillChunkOption = Annotated[
    int | None,
    typer.Option(
        help="Feed the prompt in chunks of this many tokens, every layer cut to its budget after each: the cache "
        "held never exceeds the budgets plus one chunk (methods whose layer budgets are known in advance)."
    ),
]
GenerateBatchOption = Annotated[
    int,
    typer.Option(
        help="Prompts generated together (left-padded): each row is compressed as it would be alone, and the "
        "batch decodes at once."
    ),
]
KvBitsOption = Annotated[
    int | None,
    typer.Option(help="Quantize the kept entries for decoding: 8 (FP8, built in) or 4 (int4, needs optimum-quanto)."),
]


@app.command()
def generate(
    prompt_file: Annotated[
        list[Path],
        typer.Option(
            help="Text file holding the prompt (the context in question mode). Repeat it for several prompts, or "
            'give a .jsonl file of prompts (a JSON string or {"prompt": ...} per line).'
        ),
    ],
    method: GenerateMethodOption = None,
    ratio: Annotated[
        float | None, typer.Option(help="Fraction of cache entries removed, in [0, 1) (default 0.5).")
    ] = None,
    budget: Annotated[int | None, typer.Option(help="Tokens kept per layer (instead of --ratio).")] = None,
    question: QuestionOption = None,
    memory: Annotated[str, typer.Option(help="padded (default) or masked: how per-head counts are stored.")] = "padded",
    artifact: ArtifactOption = None,
    force: Annotated[bool, typer.Option(help="Apply artifacts of another checkpoint of the same shape.")] = False,
    nearest_budget: NearestBudgetOption = False,
    option: MethodOptionOption = None,
    model: ModelOption = "default",
    prompt_format: PromptFormatOption = "auto",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 32,
    prefill_chunk_size: PrefillChunkOption = None,
    batch_size: GenerateBatchOption = 1,
    kv_bits: KvBitsOption = None,
) -> None:
    """Generate from prompt files with a compressed KV cache, then print the compression report (per batch of
    several prompts: each row's and the batch's bytes held). A prompt is the user's turn of the model's chat
    template (`--prompt-format auto`, for instruct models) or raw text."""
    with clear_errors():
        from kvcompile.cli.generation import (
            check_generation_inputs,
            compression_asked,
            generate_compressed,
            read_prompts,
        )
        from kvruntime.requests.request import parse_option_pairs

        prompts = read_prompts(prompt_file)
        positions = check_generation_inputs(
            prompts, model, prompt_format, max_new_tokens, batch_size, question, prefill_chunk_size, kv_bits
        )
        options = parse_option_pairs(option or [], method)
        asked = compression_asked(
            model, method, ratio, budget, memory, artifact or [], options, nearest_budget, prefill_chunk_size,
            positions, kv_bits,
        )  # fmt: skip
        if asked.note:
            typer.echo(f"note: {asked.note}", err=True)
        generate_compressed(
            asked, prompts, question, model, prompt_format, max_new_tokens, batch_size, force, typer.echo
        )


CorpusOption = Annotated[
    str | None,
    typer.Option(
        help="Calibration text: 'austen' (shipped, default), 'austen-repeats' (with repeating text; distill's default), "
        "'mixed' (austen-repeats with shipped code, documentation and math text), "
        "a .txt/.txt.gz file or folder, a jsonl/parquet."
    ),
]
ResumeOption = Annotated[bool, typer.Option(help="Continue an interrupted run of the same settings.")]
ShardOption = Annotated[
    str | None,
    typer.Option(
        help="i/n: do share i of n, counted from 0 (0/2 and 1/2), as a separate job and write partial statistics "
        "for `kvcompile merge` (under torchrun every rank takes its share without this)."
    ),
]
CheckpointOption = Annotated[
    int, typer.Option(help="Save the partial statistics after this many items (probes or prompts).")
]
SeedOption = Annotated[int, typer.Option(help="Seed of the probe/prompt sampling.")]
DeviceOption = Annotated[
    str,
    typer.Option(help="Where the model runs: cpu, cuda (under torchrun: each rank's cuda:LOCAL_RANK), cuda:N, mps."),
]
DtypeOption = Annotated[str, typer.Option(help="The model's dtype: float32, bfloat16 or float16.")]


def _artifact_out(kind: str) -> object:
    """The --out option of a command that writes a `kind` artifact."""
    return Annotated[Path | None, typer.Option(help=f"Output artifact (default artifacts/<model>/{kind}.safetensors).")]


# The commands that write an artifact (what `reproduce` may run), each with its parameters that read a file or folder.
COMPILE_COMMANDS: dict[str, frozenset[str]] = {}


def _reads_path(hint: object) -> bool:
    """Whether an option annotated `hint` (`Annotated[Path | None, ...]`) takes a path."""
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    return base is Path or Path in typing.get_args(base)


def settings_options(settings_type: type | None) -> list[inspect.Parameter]:
    """The command-line options of a recipe's settings: one per field made by `kvcompile.settings.option`, its type
    the field's (text for a choice's name or comma-separated values), its default and help the field's."""
    if settings_type is None:
        return []
    kinds = typing.get_type_hints(settings_type)
    options = []
    for field in command_line_fields(settings_type):
        default = command_line_default(field, kinds[field.name])
        names = [field.metadata["flag"]] if field.metadata["flag"] else []
        hint = Annotated[type(default), typer.Option(*names, help=field.metadata["help"])]
        options.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint))
    return options


def compile_command(
    kind: str, settings: type | None = None, shardable: bool = False, checkpoint_every: int = 4
) -> Callable:
    """Register a compile command. Its options are the `settings` dataclass's (`settings_options`: declared there
    once), the decorated function's own (the recipe's inputs, e.g. a corpus or another artifact), and the ones
    every compile command shares, declared here once (--model, --out, --resume, --device, --dtype, and for recipes
    that split their work --shard and --checkpoint-every). The function takes its own options (and `model`, `out`
    or the click context `ctx` if it needs them) and returns the recipe, or (recipe, settings) where it has no settings dataclass to derive;
    the command runs `compile_artifact`, refusing bad input in one line."""
    shared = {
        "model": (ModelOption, "default"),
        "out": (_artifact_out(kind), None),
        "resume": (ResumeOption, False),
        **(
            {"shard": (ShardOption, None), "checkpoint_every": (CheckpointOption, checkpoint_every)}
            if shardable
            else {}
        ),
        "device": (DeviceOption, "cpu"),
        "dtype": (DtypeOption, "float32"),
    }
    derived = settings_options(settings)

    def register(build: Callable) -> Callable:
        hints = typing.get_type_hints(build, include_extras=True)
        wanted = inspect.signature(build).parameters
        keyword = inspect.Parameter.KEYWORD_ONLY
        own = [inspect.Parameter(n, keyword, default=p.default, annotation=hints[n]) for n, p in wanted.items()]
        own = [p for p in own if p.name not in shared and p.name != "ctx"]

        def command(ctx: typer.Context, **params: object) -> None:
            job = {name: params.pop(name) for name in shared}
            given = {option.name: params.pop(option.name) for option in derived}
            with clear_errors() as resources:
                context = {"ctx": ctx} if "ctx" in wanted else {}
                built = build(**params, **context, **{name: job[name] for name in ("model", "out") if name in wanted})
                recipe_, settings_ = built if settings is None else (built, settings_from_command_line(settings, given))
                rerun = command_line(ctx, leave_out=recipe.OUTPUT_OPTIONS)
                compile_artifact(recipe_, settings_, resources=resources, echo=typer.echo, command=rerun, **job)

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = inspect.Signature(
            [context, *own, *derived]
            + [inspect.Parameter(n, keyword, default=d, annotation=a) for n, (a, d) in shared.items()]
        )
        command.__name__, command.__doc__ = build.__name__, build.__doc__
        app.command()(command)
        COMPILE_COMMANDS[build.__name__] = frozenset(p.name for p in own if _reads_path(p.annotation))
        return build

    return register


@compile_command("srh_heads", HeadsSettings, shardable=True, checkpoint_every=8)
def heads(corpus: CorpusOption = None) -> object:
    """Score every query head as a Semantic Retrieval Head (and a classic retrieval head) on needle probes."""
    from kvcompile.recipes.compresskv.recipe import HeadsRecipe

    return HeadsRecipe(corpus)


@compile_command("layer_budgets", BudgetsSettings, shardable=True)
def budgets(
    model: str,
    heads_artifact: Annotated[
        Path | None,
        typer.Option("--heads", help="srh_heads artifact (default artifacts/<model>/srh_heads.safetensors)."),
    ] = None,
    corpus: CorpusOption = None,
) -> object:
    """Measure each layer's compression error and write the inputs of the error-aware layer budgets."""
    from kvcompile.recipes.compresskv.recipe import BudgetsRecipe

    return BudgetsRecipe(corpus, heads_artifact or default_artifact(model, "srh_heads"))


@compile_command("compilerkv_tables", TablesSettings)
def tables(
    corpus: CorpusOption = None,
    from_experience: Annotated[
        Path | None, typer.Option(help="Relearn the tables from a stored compilerkv_experience artifact (no rollouts).")
    ] = None,
) -> object:
    """Learn CompilerKV's head-reliability and risk-threshold tables (offline contextual bandits, DiscreteCQL)."""
    from kvcompile.recipes.compilerkv.recipe import TablesRecipe

    return TablesRecipe(corpus, from_experience)


@compile_command("kvcompose_stats", StatsSettings, shardable=True)
def stats(
    corpus: CorpusOption = None,
    task_set: Annotated[
        Path | None,
        typer.Option(help="Task-aware mode: a text file of downstream prompts, one per line (default: task-agnostic)."),
    ] = None,
) -> object:
    """Measure KVCompose's attention statistics: composite-token curves and the layer allocation per ratio."""
    from kvcompile.recipes.kvcompose.recipe import StatsRecipe

    return StatsRecipe(corpus, task_set)


@compile_command("distilled_scorer", DistillSettings, shardable=True)
def distill(corpus: CorpusOption = None) -> object:
    """Distil a one-pass token scorer from a second pass over calibration prompts (ridge regression per layer)."""
    from kvcompile.calibration.corpus import REPEATING_CORPUS
    from kvcompile.recipes.distilled.recipe import DistillRecipe

    return DistillRecipe(corpus or REPEATING_CORPUS)


def command_line(ctx: typer.Context, leave_out: Collection[str] = ()) -> str:
    """The command with every setting spelled out (defaults included, the options named in `leave_out` left out):
    what reruns it, recorded in the reports and artifacts it writes."""
    parts = ["kvcompile", ctx.info_name]
    for option in ctx.command.params:
        value = ctx.params.get(option.name)
        if option.name in leave_out or value is None:
            continue
        if isinstance(value, bool):
            flags = option.opts if value else option.secondary_opts
            parts += flags[:1]
        else:
            parts += [option.opts[0], str(value)]
    return shlex.join(parts)
