"""`kvcompile eval` and `kvcompile tune`: the evaluation suite's options into settings, then the suite (registered
on the command line's `app` when `kvcompile.cli` loads this module)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import typer

from kvcompile import recipe
from kvcompile.cli.commands import command_line, compile_command, settings_command
from kvcompile.recipe import artifact_folders, claim_output, compiled_artifact
from kvcompile.settings import device_option, model_option, option, prompt_format_option, seed_option
from kvcompile.tasks.grid import SUITE_TASKS, TEXT_TYPES
from kvruntime import KVRuntimeError
from kvruntime.artifacts.artifact_header import headers_read_once
from kvruntime.registry import COMPARED_NAMES

DEFAULT_TASKS = "passkey,needle,multikey,multivalue,variable_tracking,common_words,qa"
TASKS_HELP = (
    f"Comma-separated, of {', '.join(SUITE_TASKS)} (each judged per text type: {', '.join(sorted(set(TEXT_TYPES.values())))}); "
    "task:N gives a task N prompts per length instead of --samples (common_words:2)."
)


def tasks_option() -> Any:
    return option(DEFAULT_TASKS, TASKS_HELP)


def lengths_option() -> Any:
    return option("2k", "Context lengths: 2k, 4k, or token counts (comma-separated).")


def suite_option() -> Any:
    return option(
        None,
        "Your own prompts instead of the built-in tasks: a JSON Lines file (context, question, answers, optional "
        "answer_prefix and id on each line) or a folder saved by datasets (or of .jsonl/.json/.parquet files).",
    )


def scoring_option() -> Any:
    return option(
        "substring",
        "How --suite's answers are scored: substring (one of the answers appears, RULER), fraction (the share of the "
        "answers that appear, RULER's string_match_all), all (1 when every answer appears, else 0), exact (SQuAD's "
        "exact match) or f1 (token F1, SQuAD/LongBench).",
    )


def question_aware_option() -> Any:
    return option(
        False,
        "Compress with the question in the observation window (default: the context alone, then the question).",
    )


def artifacts_option() -> Any:
    return option(
        None,
        "Folder of the compiled artifacts, or a bundle's folder or hub repo id (default: the model's compiled ones, "
        "else its shipped ones).",
    )


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """`kvcompile eval`'s options, each declared once (`kvcompile.settings.option`)."""

    model: str = model_option()
    methods: str | None = option(
        None,
        "Comma-separated: full, runtime method names (options as name:key=value), kvpress-<press> or kvpress (all "
        f"presses; needs the bench extra). Default: full, {', '.join(COMPARED_NAMES)}, and kvpress if installed.",
    )
    ratios: tuple[float, ...] = option((0.5, 0.75, 0.9), "Compression ratios (fraction of the cache removed).")
    tasks: str = tasks_option()
    lengths: str = lengths_option()
    samples: int = option(3, "Prompts per task and length (facts at depths spread over 0.1-0.9).")
    seed: int = seed_option()
    suite: Path | None = suite_option()
    scoring: str = scoring_option()
    question_aware: bool = question_aware_option()
    prompt_format: str = prompt_format_option()
    new_tokens: int = option(48, "Greedy tokens generated per answer (fidelity compares the first 32).")
    artifacts: Path | None = artifacts_option()
    out: Path = option(Path("eval_results"), "Output folder: results.md/.csv, summary.csv, plots, run records.")
    resume: bool = option(False, "Continue an interrupted run of the same settings, or add methods to a finished one.")
    batch_size: int = option(
        1,
        "Prompts a kvcompile method answers at once (each compressed as alone; peak memory is then not measured per "
        "prompt). The full cache and kvpress's presses answer one by one.",
    )
    shared_prefill: bool = option(
        True,
        "Prefill each context once with the full cache and cut every method's cache from that forward (the same "
        "records, several times faster: each method's prefill time is the shared forward plus its own scoring and "
        "cut, and peak memory is not measured); streamed prompts and presses with passes of their own still prefill "
        "alone. --own-prefills gives every method its own prefill, timed and measured.",
        flag="--shared-prefill/--own-prefills",
    )
    device: str = device_option()


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """`kvcompile tune`'s own options (beside every compile command's), each declared once."""

    tolerance: float = option(0.02, "Largest accuracy loss against the full cache accepted (0.02 = 2 points).")
    methods: str = option(
        ",".join(COMPARED_NAMES), "Runtime methods to tune (comma-separated, options as name:key=value)."
    )
    ratios: tuple[float, ...] = option(
        (0.25, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9),
        "Ratios tried, in increasing order until a method leaves the tolerance.",
    )
    tasks: str = tasks_option()
    lengths: str = lengths_option()
    samples: int = option(2, "Validation prompts per task and length.")
    seed: int = option(1, "Seed of the validation prompts (kvcompile eval uses 0 by default).")
    suite: Path | None = suite_option()
    scoring: str = scoring_option()
    question_aware: bool = question_aware_option()
    prompt_format: str = prompt_format_option()
    artifacts: Path | None = artifacts_option()


def _samples_text(settings: object) -> str:
    """'4 per task and length' (with the tasks given their own count: '4 per task and length, common_words 2')."""
    own = ", ".join(f"{task} {count}" for task, count in settings.task_samples.items())
    return f"{settings.samples} per task and length" + (f", {own}" if own else "")


def _suite_settings(
    options: EvalOptions | TuneOptions, ratios: tuple[float, ...], new_tokens: int, positions: int | None
) -> object:
    """The suite settings of eval and tune, from their options: the built-in tasks, or a user's suite file scored by
    `options.scoring`, each of its rows short enough for the model's `positions` (None: not known)."""
    from kvcompile.evaluation.settings import SuiteSettings
    from kvcompile.tasks.grid import parse_lengths, parse_tasks
    from kvcompile.tasks.own_suite import check_row_fits, read_suite

    task_names, task_samples = parse_tasks(options.tasks)
    own = {}
    if options.suite is not None:  # every row checked here, before torch loads
        suite = read_suite(options.suite)
        for row in suite.rows:
            check_row_fits(row, positions)
        own = dict(suite=str(options.suite), suite_sha256=suite.sha256, scoring=options.scoring)
    return SuiteSettings(
        ratios=ratios,
        tasks=task_names,
        task_samples=task_samples,
        lengths=tuple(parse_lengths(options.lengths)),
        samples=options.samples,
        seed=options.seed,
        question_aware=options.question_aware,
        new_tokens=new_tokens,
        prompt_format=options.prompt_format,
        **own,
    )


def _prompts_text(settings: object, records: list[dict]) -> str:
    """'36 prompts (tasks ...; lengths ...; 2 per task and length; seed 10)', or a user's suite's name and scoring."""
    count = len({r["prompt"] for r in records})
    if settings.suite is not None:
        return (
            f"{count} prompts of the suite {settings.suite_name} (sha256 {settings.suite_sha256[:12]}), scored by "
            f"{settings.scoring}"
        )
    return (
        f"{count} prompts (tasks {', '.join(settings.tasks)}; lengths {', '.join(map(str, settings.lengths))}; "
        f"{_samples_text(settings)}; seed {settings.seed})"
    )


def _report_header(model: str, command: str, machine: str, records: list[dict], settings: object) -> str:
    """The head of the eval's results.md: what ran, where, on which prompts, and how they were answered."""
    import datetime

    asked = (
        "question-aware"
        if settings.question_aware
        else "question-agnostic (the context is compressed before the question is seen)"
    )
    lines = [
        f"# kvcompile eval: {model}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Finished: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
        f"{_prompts_text(settings, records)}, {asked}, greedy, {settings.new_tokens} new tokens.",
        "",
    ]
    return "\n".join(lines)


def check_suite_alone(ctx: typer.Context, suite: Path | None) -> None:
    """Refuse the built-in suite's options beside --suite (they would be silently ignored), and --scoring without
    it (the built-in tasks are scored by their own rule)."""
    # By the source's name: typer carries its own copy of click, whose enum is not click's.
    given = [name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]
    if suite is not None:
        clash = [name for name in ("tasks", "lengths", "samples", "seed") if name in given]
        if clash:
            raise KVRuntimeError(f"--{clash[0]} picks the built-in suite's prompts: it does not apply with --suite")
    elif "scoring" in given:
        raise KVRuntimeError("--scoring scores a --suite of your own: the built-in tasks are scored by their rule")


@settings_command(EvalOptions, name="eval")
def eval_(options: EvalOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Run the long-context suite through each method at each ratio and write accuracy and fidelity tables and plots."""
    from kvcompile.evaluation.contestants import artifact_paths, default_methods, parse_methods, resolve_contestants
    from kvcompile.evaluation.store import RunStore
    from kvruntime.models.model_spec import check_model_spec, check_request_fits, model_facts

    check_model_spec(options.model)
    facts = model_facts(options.model)  # from the model's config or GGUF header, read once
    recipe.check_device_name(options.device)
    check_suite_alone(ctx, options.suite)
    settings = _suite_settings(options, options.ratios, options.new_tokens, facts.positions)
    settings.check()
    settings.check_positions(facts.positions)
    if options.batch_size < 1:
        raise KVRuntimeError(f"--batch-size {options.batch_size}: give at least 1 prompt per batch")
    ctx.params["methods"] = methods = options.methods or default_methods()
    contestants = parse_methods(methods)
    quantized = any(contestant.kv_bits is not None for contestant in contestants)
    check_request_fits(facts, quantized, options.batch_size > 1, options.prompt_format == "chat")
    with headers_read_once():  # the fingerprints checked from the headers resolving read
        paths = artifact_paths(
            contestants, (options.artifacts,) if options.artifacts else artifact_folders(options.model)
        )
        contestants = resolve_contestants(contestants, paths, settings.ratios)
        files = [path for files in paths.values() for path in files if path.suffix == ".safetensors"]
        recipe.refuse_other_models_artifacts(options.model, files)  # before the weights load
    record = {"model": options.model, "methods": [c.label for c in contestants], **settings.record()}
    if not settings.task_samples:  # runs recorded before per-task counts existed stay resumable
        del record["task_samples"]
    claim_output(resources, options.out, folder=True)
    store = RunStore(options.out, record, options.resume, extendable=("methods",))

    from kvcompile.evaluation.measure import machine
    from kvcompile.evaluation.report import write_report
    from kvcompile.evaluation.suite_run import evaluate
    from kvruntime.models.model_spec import loaded_position_limit

    loaded, tokenizer = recipe.load_model(options.model, device=recipe.resolve_device(options.device))
    settings.check_positions(loaded_position_limit(loaded.config))
    records = evaluate(
        loaded, tokenizer, contestants, paths, settings, store, options.batch_size, options.shared_prefill
    )
    # What reruns it: the built-in suite's options are refused beside --suite, --scoring without it.
    unused = ("tasks", "lengths", "samples", "seed") if options.suite is not None else ("scoring",)
    header = _report_header(options.model, command_line(ctx, leave_out=unused), machine(), records, settings)
    # The first method after the full cache (a quantized full cache runs at ratio 0 only: nothing to pair with).
    subject = next((c.label for c in contestants[1:] if c.compresses), None)
    written, summary = write_report(records, options.out, header, subject)
    for path in written:
        typer.echo(f"wrote {path}")
    typer.echo(summary)


@compile_command("tuned_defaults", None, TuneOptions)
def tune(inputs: TuneOptions, ctx: typer.Context, model: str, out: Path | None) -> tuple:
    """Pick, per method, the largest compression ratio whose validation accuracy stays within the tolerance of the
    full cache, and write the best as the runtime's default (a tuned_defaults artifact)."""
    from kvcompile.recipes.tuned_defaults.recipe import TuneRecipe
    from kvcompile.recipes.tuned_defaults.settings import TuneSettings
    from kvruntime.models.model_spec import check_request_fits, model_facts

    check_suite_alone(ctx, inputs.suite)
    facts = model_facts(model)  # tune answers one prompt at a time, unquantized: only the prompt format to check
    check_request_fits(facts, kv_bits=False, batch=False, chat=inputs.prompt_format == "chat")
    validation = _suite_settings(inputs, tuple(sorted(inputs.ratios)), 48, facts.positions)
    target = out or compiled_artifact(model, "tuned_defaults")  # where compile_artifact writes it
    records = target.with_name(target.stem + ".runs")
    settings = TuneSettings(validation, inputs.tolerance)
    folders = (inputs.artifacts,) if inputs.artifacts else artifact_folders(model)
    return TuneRecipe(target.parent, inputs.methods, folders, records, model), settings
