"""`kvcompile eval` and `kvcompile tune`: the evaluation suite's options into settings, then the suite (registered
on the command line's `app` when `kvcompile.cli` loads this module)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcompile import recipe
from kvcompile.cli.commands import (
    DeviceOption,
    ModelOption,
    PromptFormatOption,
    SeedOption,
    app,
    clear_errors,
    command_line,
    compile_command,
)
from kvcompile.recipe import artifact_folder, claim_output, default_artifact
from kvcompile.settings import comma_separated
from kvruntime import KVRuntimeError
from kvruntime.registry import COMPARED_NAMES

MethodsOption = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated: full, runtime method names (options as name:key=value), kvpress-<press> or kvpress "
        f"(all presses; needs the bench extra). Default: full, {', '.join(COMPARED_NAMES)}, and kvpress if installed."
    ),
]
TasksOption = Annotated[
    str,
    typer.Option(
        help="passkey, needle, multikey, multivalue, variable_tracking, common_words, qa (comma-separated); "
        "task:N gives a task N prompts per length instead of --samples (common_words:2)."
    ),
]
LengthsOption = Annotated[str, typer.Option(help="Context lengths: 2k, 4k, or token counts (comma-separated).")]
QuestionAwareOption = Annotated[
    bool,
    typer.Option(
        help="Compress with the question in the observation window (default: the context alone, then the question)."
    ),
]
SuiteOption = Annotated[
    Path | None,
    typer.Option(
        help="Your own prompts instead of the built-in tasks: a JSON Lines file (context, question, answers, optional "
        "answer_prefix and id on each line) or a folder saved by datasets (or of .jsonl/.json/.parquet files)."
    ),
]
ScoringOption = Annotated[
    str,
    typer.Option(
        help="How --suite's answers are scored: substring (one of the answers appears, RULER), fraction (the share of "
        "the answers that appear, RULER's string_match_all), all (1 when every answer appears, else 0), exact "
        "(SQuAD's exact match) or f1 (token F1, SQuAD/LongBench)."
    ),
]
RatiosOption = Annotated[str, typer.Option(help="Compression ratios (fraction of the cache removed).")]
EvalResumeOption = Annotated[
    bool, typer.Option(help="Continue an interrupted run of the same settings, or add methods to a finished one.")
]
EvalBatchOption = Annotated[
    int,
    typer.Option(
        help="Prompts a kvcompile method answers at once (each compressed as alone; peak memory is then not "
        "measured per prompt). The full cache and kvpress's presses answer one by one."
    ),
]
SharedPrefillOption = Annotated[
    bool,
    typer.Option(
        "--shared-prefill/--own-prefills",
        help="Prefill each context once with the full cache and cut every method's cache from that forward (the "
        "same records, several times faster: each method's prefill time is the shared forward plus its own "
        "scoring and cut, and peak memory is not measured); streamed prompts and presses with passes of their "
        "own still prefill alone. --own-prefills gives every method its own prefill, timed and measured.",
    ),
]
ArtifactsOption = Annotated[
    Path | None,
    typer.Option(
        help="Folder of the compiled artifacts, or a bundle's folder or hub repo id (default artifacts/<model>/)."
    ),
]


def _samples_text(settings: object) -> str:
    """'4 per task and length' (with the tasks given their own count: '4 per task and length, common_words 2')."""
    own = ", ".join(f"{task} {count}" for task, count in settings.task_samples.items())
    return f"{settings.samples} per task and length" + (f", {own}" if own else "")


def _suite_settings(
    ratios: tuple[float, ...],
    tasks: str,
    lengths: str,
    samples: int,
    seed: int,
    question_aware: bool,
    new_tokens: int,
    prompt_format: str,
    suite: Path | None = None,
    scoring: str = "substring",
) -> object:
    """The suite settings of eval and tune, from their options: the built-in tasks, or a user's `suite` file scored
    by `scoring`."""
    from kvcompile.evaluation.settings import SuiteSettings
    from kvcompile.tasks.grid import parse_lengths, parse_tasks
    from kvcompile.tasks.own_suite import read_suite

    task_names, task_samples = parse_tasks(tasks)
    own = {}
    if suite is not None:  # every row checked here, before torch loads
        own = dict(suite=str(suite), suite_sha256=read_suite(suite).sha256, scoring=scoring)
    return SuiteSettings(
        ratios=ratios,
        tasks=task_names,
        task_samples=task_samples,
        lengths=tuple(parse_lengths(lengths)),
        samples=samples,
        seed=seed,
        question_aware=question_aware,
        new_tokens=new_tokens,
        prompt_format=prompt_format,
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


@app.command(name="eval")
def eval_(
    ctx: typer.Context,
    model: ModelOption = "default",
    methods: MethodsOption = None,
    ratios: RatiosOption = "0.5,0.75,0.9",
    tasks: TasksOption = "passkey,needle,multikey,multivalue,variable_tracking,common_words,qa",
    lengths: LengthsOption = "2k",
    samples: Annotated[
        int, typer.Option(help="Prompts per task and length (facts at depths spread over 0.1-0.9).")
    ] = 3,
    seed: SeedOption = 0,
    suite: SuiteOption = None,
    scoring: ScoringOption = "substring",
    question_aware: QuestionAwareOption = False,
    prompt_format: PromptFormatOption = "auto",
    new_tokens: Annotated[
        int, typer.Option(help="Greedy tokens generated per answer (fidelity compares the first 32).")
    ] = 48,
    artifacts: ArtifactsOption = None,
    out: Annotated[Path, typer.Option(help="Output folder: results.md/.csv, summary.csv, plots, run records.")] = Path(
        "eval_results"
    ),
    resume: EvalResumeOption = False,
    batch_size: EvalBatchOption = 1,
    shared_prefill: SharedPrefillOption = True,
    device: DeviceOption = "cpu",
) -> None:
    """Run the long-context suite through each method at each ratio and write accuracy and fidelity tables and plots."""
    with clear_errors() as resources:
        from kvcompile.evaluation.contestants import artifact_paths, default_methods, parse_methods, resolve_contestants
        from kvcompile.evaluation.store import RunStore
        from kvruntime.models.model_spec import check_model_spec, position_limit

        check_model_spec(model)
        recipe.check_device_name(device)
        check_suite_alone(ctx, suite)
        settings = _suite_settings(
            comma_separated(ratios, float), tasks, lengths, samples, seed, question_aware, new_tokens, prompt_format,
            suite, scoring,
        )  # fmt: skip
        settings.check()
        settings.check_positions(position_limit(model))
        if batch_size < 1:
            raise KVRuntimeError(f"--batch-size {batch_size}: give at least 1 prompt per batch")
        ctx.params["methods"] = methods = methods or default_methods()
        contestants = parse_methods(methods)
        paths = artifact_paths(contestants, artifacts or artifact_folder(model))
        contestants = resolve_contestants(contestants, paths, settings.ratios)
        record = {"model": model, "methods": [c.label for c in contestants], **settings.record()}
        if not settings.task_samples:  # runs recorded before per-task counts existed stay resumable
            del record["task_samples"]
        claim_output(resources, out, folder=True)
        store = RunStore(out, record, resume, extendable=("methods",))

        from kvcompile.evaluation.measure import machine
        from kvcompile.evaluation.report import write_report
        from kvcompile.evaluation.suite_run import evaluate

        loaded, tokenizer = recipe.load_model(model, device=recipe.resolve_device(device))
        settings.check_positions(getattr(loaded.config, "max_position_embeddings", None))
        records = evaluate(loaded, tokenizer, contestants, paths, settings, store, batch_size, shared_prefill)
        # What reruns it: the built-in suite's options are refused beside --suite, --scoring without it.
        unused = ("tasks", "lengths", "samples", "seed") if suite is not None else ("scoring",)
        header = _report_header(model, command_line(ctx, leave_out=unused), machine(), records, settings)
        # The first method after the full cache (a quantized full cache runs at ratio 0 only: nothing to pair with).
        subject = next((c.label for c in contestants[1:] if c.compresses), None)
        written, summary = write_report(records, out, header, subject)
        for path in written:
            typer.echo(f"wrote {path}")
        typer.echo(summary)


@compile_command("tuned_defaults")
def tune(
    ctx: typer.Context,
    model: str,
    out: Path | None,
    tolerance: Annotated[
        float, typer.Option(help="Largest accuracy loss against the full cache accepted (0.02 = 2 points).")
    ] = 0.02,
    methods: Annotated[
        str, typer.Option(help="Runtime methods to tune (comma-separated, options as name:key=value).")
    ] = ",".join(COMPARED_NAMES),
    ratios: Annotated[
        str, typer.Option(help="Ratios tried, in increasing order until a method leaves the tolerance.")
    ] = "0.25,0.5,0.6,0.7,0.75,0.8,0.85,0.9",
    tasks: TasksOption = "passkey,needle,multikey,multivalue,variable_tracking,common_words,qa",
    lengths: LengthsOption = "2k",
    samples: Annotated[int, typer.Option(help="Validation prompts per task and length.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the validation prompts (kvcompile eval uses 0 by default).")] = 1,
    suite: SuiteOption = None,
    scoring: ScoringOption = "substring",
    question_aware: QuestionAwareOption = False,
    prompt_format: PromptFormatOption = "auto",
    artifacts: ArtifactsOption = None,
) -> tuple:
    """Pick, per method, the largest compression ratio whose validation accuracy stays within the tolerance of the
    full cache, and write the best as the runtime's default (a tuned_defaults artifact)."""
    from kvcompile.recipes.tuned_defaults.recipe import TuneRecipe
    from kvcompile.recipes.tuned_defaults.settings import TuneSettings

    check_suite_alone(ctx, suite)
    validation = _suite_settings(
        tuple(sorted(comma_separated(ratios, float))), tasks, lengths, samples, seed, question_aware, 48, prompt_format,
        suite, scoring,
    )  # fmt: skip
    target = out or default_artifact(model, "tuned_defaults")  # where compile_artifact writes it
    records = target.with_name(target.stem + ".runs")
    return TuneRecipe(methods, artifacts or target.parent, records, model), TuneSettings(validation, tolerance)
