"""The `kvcompile` command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvruntime.errors import KVRuntimeError

app = typer.Typer(
    help="Compile KV-cache compression artifacts for a model, and run compressed generation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelOption = Annotated[
    str, typer.Option(help="'default' (SmolLM2-135M-Instruct), a local model directory, or a cached hub id.")
]


@contextlib.contextmanager
def clear_errors() -> Iterator[contextlib.ExitStack]:
    """Bad input ends the command with one line naming the problem and a non-zero exit, no traceback. Yields the
    command's resources (output locks), released when it ends."""
    try:
        with contextlib.ExitStack() as resources:
            yield resources
    except KVRuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _claim_output(resources: contextlib.ExitStack, path: Path, folder: bool = False, lock: bool = True) -> Path:
    """Check, before any work, that `path` can be written (a file, or with `folder` a folder), and hold its lock
    for the rest of the command, so that two runs never write the same output at once."""
    from kvruntime.files import check_output_file, check_output_folder, path_lock

    (check_output_folder if folder else check_output_file)(path)
    if lock:
        resources.enter_context(path_lock(path, wait=False))
    return path


DEFAULT_ARTIFACT_FOLDER = "smollm2-135m-instruct"
MIN_PROBE_TOKENS = 128  # a needle sentence, its question and some haystack around it

PromptFormatOption = Annotated[
    str, typer.Option(help="chat (the model's chat template), raw (base models), or auto (chat when the tokenizer has a template).")
]


def _load(model: str) -> tuple:
    import transformers

    import kvruntime

    transformers.utils.logging.disable_progress_bar()
    return kvruntime.load_model(model)


def _read_prompt(path: Path) -> str:
    if path.is_dir():
        raise KVRuntimeError(f"prompt file {path} is a folder: give a text file")
    if not path.is_file():
        raise KVRuntimeError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KVRuntimeError(f"prompt file {path} is not UTF-8 text") from None
    if not text.strip():
        raise KVRuntimeError(f"prompt file {path} is empty")
    return text


@app.command()
def generate(
    prompt_file: Annotated[Path, typer.Option(help="Text file holding the prompt (the context in question mode).")],
    method: Annotated[
        Optional[str],
        typer.Option(
            help="snapkv, kvcompress, srh, compresskv (= srh+budgets), <method>+budgets, compilerkv, or kvcompose. "
            "Default: the method and ratio of artifacts/<model>/tuned_defaults.safetensors (`kvcompile tune`) if "
            "there is one, else kvcompress."
        ),
    ] = None,
    ratio: Annotated[Optional[float], typer.Option(help="Fraction of cache entries removed, in [0, 1) (default 0.5).")] = None,
    budget: Annotated[Optional[int], typer.Option(help="Tokens kept per layer (instead of --ratio).")] = None,
    question: Annotated[
        Optional[list[str]],
        typer.Option(help="Question mode: compress the prompt without the question, then answer each --question."),
    ] = None,
    memory: Annotated[str, typer.Option(help="padded (default) or masked: how per-head counts are stored.")] = "padded",
    artifact: Annotated[Optional[list[Path]], typer.Option(help="Compiled artifact(s), checked against the model.")] = None,
    force: Annotated[bool, typer.Option(help="Apply artifacts of another checkpoint of the same shape.")] = False,
    nearest_budget: Annotated[
        bool, typer.Option(help="compilerkv: use the tables of the nearest compiled budget for a budget not compiled.")
    ] = False,
    option: Annotated[
        Optional[list[str]],
        typer.Option(help="A method option as key=value, e.g. mode=dynamic or unstructured=true for kvcompose."),
    ] = None,
    model: ModelOption = "default",
    prompt_format: PromptFormatOption = "auto",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 32,
) -> None:
    """Generate from a prompt file with a compressed KV cache, then print the compression report. The prompt file
    is the user's turn of the model's chat template (`--prompt-format auto`, for instruct models) or raw text."""
    with clear_errors():
        from kvruntime.request import check_method_options, check_request, parse_option_pairs, required_artifact_kinds

        from .prompt_format import check_prompt_format

        prompt = _read_prompt(prompt_file)
        check_prompt_format(prompt_format)
        if max_new_tokens < 1:
            raise KVRuntimeError(f"--max-new-tokens {max_new_tokens}: give at least 1 token to generate")
        if question is not None and not all(text.strip() for text in question):
            raise KVRuntimeError("--question is empty: give the text of each question")
        options = parse_option_pairs(option or [])
        if options and method is None:
            raise KVRuntimeError("--option needs --method: options belong to a method")
        if method is not None:
            options = check_method_options(method, options)
        if nearest_budget:
            options["nearest_budget"] = True
        paths = list(artifact or [])
        if method is None:
            from kvruntime.artifact import read_artifact

            # The method and ratio of a tuned_defaults artifact (given, or the model's default one), else kvcompress.
            tuned = _default_artifact(model, "tuned_defaults")
            paths = paths or ([tuned] if tuned.exists() else [])
            if not any(p.exists() and read_artifact(p).kind == "tuned_defaults" for p in paths):
                method = "kvcompress"
        if method is not None:
            if ratio is None and budget is None:
                ratio = 0.5
            kinds = required_artifact_kinds(method, options)
            paths = paths or [_default_artifact(model, kind) for kind in kinds]
        if ratio is not None or budget is not None:  # else the tuned defaults give the ratio
            check_request(ratio, budget, memory)
        for path in paths:
            if not path.exists():
                raise KVRuntimeError(
                    f"method {method!r} needs {path}: compile it (`kvcompile heads` for srh_heads, `kvcompile "
                    "budgets` for layer_budgets, `kvcompile tables` for compilerkv_tables, `kvcompile stats` for "
                    "kvcompose_stats) or pass --artifact"
                )
        import torch

        import kvruntime

        from .prompt_format import chat_frame, uses_chat

        loaded, tokenizer = _load(model)
        chat = uses_chat(tokenizer, prompt_format)
        turn_start, turn_end = chat_frame(tokenizer) if chat else ("", "")

        def encode(text: str, special: bool = False):
            return tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids

        greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
        with kvruntime.compress(
            loaded, method, ratio=ratio, budget=budget, memory=memory, artifacts=paths, force=force, options=options
        ) as session:
            # Chat: the file is the user's turn, stripped as a chat front end sends it; raw: the text as it is.
            context = prompt.strip() if chat else prompt
            if encode(context).shape[1] < 2:
                raise KVRuntimeError(f"prompt file {prompt_file} holds fewer than 2 tokens: nothing to compress")
            if question:
                # The context is compressed inside the user's turn; each question ends the turn.
                compressed = session.prefill(encode(turn_start + context, special=not chat))
                separator = "\n\n" if chat else ("" if prompt[-1].isspace() else "\n")
                for text in question:
                    question_ids = encode(separator + text.strip() + turn_end)
                    answer = compressed.generate(question_ids, **greedy)[0, question_ids.shape[1] :]
                    typer.echo(f"Q: {text.strip()}\nA: {tokenizer.decode(answer, skip_special_tokens=True).strip()}")
            else:
                ids = encode(turn_start + context + turn_end, special=not chat)
                output = loaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy)
                typer.echo(tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip())
        typer.echo(str(session.report))


def _numbers(text: str, convert: type) -> list:
    try:
        return [convert(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVRuntimeError(f"expected comma-separated {convert.__name__} values, got {text!r}") from None


def _artifact_folder(model: str) -> Path:
    from .shipped import shipped_folder

    return shipped_folder("artifacts") / (DEFAULT_ARTIFACT_FOLDER if model == "default" else Path(model).name)


def _default_artifact(model: str, kind: str) -> Path:
    return _artifact_folder(model) / f"{kind}.safetensors"


def _finish(artifact: object, out: Path, plot: Callable[[object, Path], str], started: float, shard: object = None) -> None:
    """Save the artifact with the command's wall time since `started` (a resumed run counts its last part only),
    then drop the run's checkpoints (only once the artifact is safely written), then draw its picture beside it.
    In a process group rank 0 writes; partial statistics of a separate job get no picture."""
    from kvruntime.artifact import save_artifact

    from .checkpoint import discard_checkpoint
    from .distributed import Shard, wait_for_all
    from .partial_statistics import PARTIAL_KIND

    shard = shard or Shard()
    if shard.writes_results:
        artifact.provenance["compile_seconds"] = round(time.perf_counter() - started, 1)
        save_artifact(artifact, out)
    wait_for_all(shard)
    discard_checkpoint(out, shard)
    if not shard.writes_results:
        return
    typer.echo(f"wrote {out}")
    if artifact.kind == PARTIAL_KIND:
        done, total = int(artifact.tensors["items_done"].sum()), artifact.params["items"]
        typer.echo(f"partial statistics ({done} of {total} items): add the other shards with `kvcompile merge`")
    else:
        typer.echo(plot(artifact, out.with_suffix(".png")))


def _compile_target(out: Optional[Path], model: str, kind: str, shard: object) -> Path:
    """--out, else the model's default artifact; a separate job's partial statistics get a name of their own."""
    if out is not None:
        return out
    if shard.in_process_group or shard.is_whole:
        return _default_artifact(model, kind)
    return _default_artifact(model, f"{kind}.shard{shard.index}of{shard.count}")


CorpusOption = Annotated[
    Optional[str],
    typer.Option(help="Calibration text: 'austen' (shipped, default), a .txt/.txt.gz file or folder, a jsonl/parquet."),
]
ResumeOption = Annotated[bool, typer.Option(help="Continue an interrupted run of the same settings.")]
ShardOption = Annotated[
    Optional[str],
    typer.Option(
        help="i/n: do share i of n, counted from 0 (0/2 and 1/2), as a separate job and write partial statistics "
        "for `kvcompile merge` (under torchrun every rank takes its share without this)."
    ),
]
CheckpointOption = Annotated[int, typer.Option(help="Save the partial statistics after this many items (probes or prompts).")]
SeedOption = Annotated[int, typer.Option(help="Seed of the probe/prompt sampling.")]


@app.command()
def heads(
    model: ModelOption = "default",
    corpus: CorpusOption = None,
    lengths: Annotated[str, typer.Option(help="Probe context lengths in tokens.")] = "512,1024,1536,2048",
    depths: Annotated[str, typer.Option(help="Needle depths (0 = start, 1 = end).")] = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
    prompt_format: Annotated[str, typer.Option(help="chat (the model's chat template) or raw (base models).")] = "chat",
    seed: SeedOption = 0,
    out: Annotated[Optional[Path], typer.Option(help="Output artifact (default artifacts/<model>/srh_heads.safetensors).")] = None,
    resume: ResumeOption = False,
    shard: ShardOption = None,
    checkpoint_every: CheckpointOption = 8,
) -> None:
    """Score every query head as a Semantic Retrieval Head (and a classic retrieval head) on needle probes."""
    started = time.perf_counter()
    with clear_errors() as resources:
        from .corpus import load_corpus
        from .distributed import parse_shard
        from .heads import compile_head_scores
        from .plots import plot_head_scores

        grid_lengths, grid_depths = _numbers(lengths, int), _numbers(depths, float)
        if not grid_lengths or not grid_depths or any(not 0 <= d <= 1 for d in grid_depths):
            raise KVRuntimeError("--lengths needs at least one length and --depths values in [0, 1]")
        if min(grid_lengths) < MIN_PROBE_TOKENS:
            raise KVRuntimeError(f"--lengths {min(grid_lengths)}: a needle probe needs at least {MIN_PROBE_TOKENS} tokens")
        if prompt_format not in ("chat", "raw"):
            raise KVRuntimeError(f"--prompt-format {prompt_format!r}: use chat or raw")
        _check_checkpoint_every(checkpoint_every)
        text = load_corpus(corpus)
        share = parse_shard(shard)
        target = _claim_output(resources, _compile_target(out, model, "srh_heads", share), lock=share.writes_results)
        loaded, tokenizer = _load(model)
        longest = getattr(loaded.config, "max_position_embeddings", None)
        if longest is not None and max(grid_lengths) > longest:
            raise KVRuntimeError(f"--lengths {max(grid_lengths)} is longer than the model's {longest} positions")
        artifact = compile_head_scores(
            loaded, tokenizer, text, grid_lengths, grid_depths, seed, target, prompt_format == "chat", resume,
            checkpoint_every, share,
        )
        _finish(artifact, target, plot_head_scores, started, share)
        if share.writes_results and artifact.kind == "srh_heads":
            from .head_comparison import describe_head_comparison

            typer.echo(describe_head_comparison(artifact))


@app.command()
def budgets(
    model: ModelOption = "default",
    heads_artifact: Annotated[
        Optional[Path], typer.Option("--heads", help="srh_heads artifact (default artifacts/<model>/srh_heads.safetensors).")
    ] = None,
    corpus: CorpusOption = None,
    prompts: Annotated[int, typer.Option(help="Calibration prompts.")] = 24,
    prompt_tokens: Annotated[int, typer.Option(help="Tokens per calibration prompt.")] = 1024,
    new_tokens: Annotated[int, typer.Option(help="Greedy decoding steps measured per prompt.")] = 32,
    seed: SeedOption = 0,
    out: Annotated[Optional[Path], typer.Option(help="Output artifact (default artifacts/<model>/layer_budgets.safetensors).")] = None,
    resume: ResumeOption = False,
    shard: ShardOption = None,
    checkpoint_every: CheckpointOption = 4,
) -> None:
    """Measure each layer's compression error and write the inputs of the error-aware layer budgets."""
    started = time.perf_counter()
    with clear_errors() as resources:
        from kvruntime.artifact import load_artifact

        from .budgets import compile_layer_errors
        from .corpus import load_corpus
        from .distributed import parse_shard
        from .plots import plot_layer_budgets

        if min(prompts, prompt_tokens, new_tokens) < 1:
            raise KVRuntimeError("--prompts, --prompt-tokens and --new-tokens must be positive")
        _check_checkpoint_every(checkpoint_every)
        text = load_corpus(corpus)
        share = parse_shard(shard)
        target = _claim_output(resources, _compile_target(out, model, "layer_budgets", share), lock=share.writes_results)
        loaded, tokenizer = _load(model)
        head_scores = load_artifact(heads_artifact or _default_artifact(model, "srh_heads"), model=loaded, kind="srh_heads")
        artifact = compile_layer_errors(
            loaded, tokenizer, text, head_scores, prompts, prompt_tokens, new_tokens, seed, target, resume,
            checkpoint_every, share,
        )
        _finish(artifact, target, plot_layer_budgets, started, share)


@app.command()
def tables(
    model: ModelOption = "default",
    budgets: Annotated[str, typer.Option(help="Budgets (tokens per layer, window included) to compile tables for.")] = "128,256,512,1024",
    corpus: CorpusOption = None,
    rounds: Annotated[int, typer.Option(help="At most this many rounds of head then gate learning.")] = 2,
    prompts: Annotated[int, typer.Option(help="Calibration prompts (context + continuation).")] = 32,
    context: Annotated[int, typer.Option(help="Tokens of context per calibration prompt.")] = 2048,
    continuation: Annotated[int, typer.Option(help="Tokens of continuation whose NLL is the reward.")] = 128,
    seed: SeedOption = 0,
    out: Annotated[Optional[Path], typer.Option(help="Output artifact (default artifacts/<model>/compilerkv_tables.safetensors).")] = None,
    resume: ResumeOption = False,
    from_experience: Annotated[
        Optional[Path], typer.Option(help="Relearn the tables from a stored compilerkv_experience artifact (no rollouts).")
    ] = None,
) -> None:
    """Learn CompilerKV's head-reliability and risk-threshold tables (offline contextual bandits, DiscreteCQL)."""
    started = time.perf_counter()
    with clear_errors() as resources:
        from kvruntime.artifact import load_artifact, save_artifact

        from .corpus import load_corpus
        from .plots import plot_compilerkv_tables
        from .tables import TablesSettings, compile_tables, relearn_tables

        settings = TablesSettings(
            budgets=tuple(_numbers(budgets, int)), prompts=prompts, context=context, continuation=continuation,
            rounds=rounds, seed=seed,
        )
        if from_experience is None:
            settings.check()  # bad settings are refused before the model and corpus are loaded
        target = _claim_output(resources, out or _default_artifact(model, "compilerkv_tables"))
        loaded, tokenizer = _load(model)
        if from_experience is not None:
            experience = load_artifact(from_experience, model=loaded, kind="compilerkv_experience")
            artifact = relearn_tables(experience)
        else:
            artifact, experience = compile_tables(loaded, tokenizer, load_corpus(corpus), settings, target, resume)
            experience_path = target.with_name("compilerkv_experience.safetensors")
            save_artifact(experience, experience_path)
            typer.echo(f"wrote {experience_path}")
        _finish(artifact, target, plot_compilerkv_tables, started)
        typer.echo(describe_tables(artifact))


@app.command()
def stats(
    model: ModelOption = "default",
    corpus: CorpusOption = None,
    task_set: Annotated[
        Optional[Path], typer.Option(help="Task-aware mode: a text file of downstream prompts, one per line (default: task-agnostic).")
    ] = None,
    ratios: Annotated[
        str, typer.Option(help="Target compression ratios to compile the allocation for (others in between are interpolated).")
    ] = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.75,0.8,0.85,0.9,0.95",
    prompts: Annotated[int, typer.Option(help="Calibration prompts.")] = 24,
    prompt_tokens: Annotated[int, typer.Option(help="Tokens per calibration prompt.")] = 2048,
    seed: SeedOption = 0,
    out: Annotated[Optional[Path], typer.Option(help="Output artifact (default artifacts/<model>/kvcompose_stats.safetensors).")] = None,
    resume: ResumeOption = False,
    shard: ShardOption = None,
    checkpoint_every: CheckpointOption = 4,
) -> None:
    """Measure KVCompose's attention statistics: composite-token curves and the layer allocation per ratio."""
    started = time.perf_counter()
    with clear_errors() as resources:
        from .attention_stats import StatsSettings, compile_attention_stats, load_task_set
        from .corpus import load_corpus
        from .distributed import parse_shard
        from .plots import plot_kvcompose_stats

        settings = StatsSettings(ratios=tuple(_numbers(ratios, float)), prompts=prompts, prompt_tokens=prompt_tokens, seed=seed)
        settings.check()  # bad settings and inputs are refused before the model is loaded
        _check_checkpoint_every(checkpoint_every)
        tasks = load_task_set(task_set) if task_set is not None else None
        text = load_corpus(corpus)
        share = parse_shard(shard)
        target = _claim_output(resources, _compile_target(out, model, "kvcompose_stats", share), lock=share.writes_results)
        loaded, tokenizer = _load(model)
        artifact = compile_attention_stats(loaded, tokenizer, text, settings, target, tasks, resume, checkpoint_every, share)
        _finish(artifact, target, plot_kvcompose_stats, started, share)


MethodsOption = Annotated[
    Optional[str],
    typer.Option(
        help="Comma-separated: full, runtime method names (options as name:key=value), kvpress-<press> or kvpress "
        "(all presses; needs the bench extra). Default: full and kvcompile's five methods, plus kvpress if installed."
    ),
]
TasksOption = Annotated[
    str, typer.Option(help="passkey, needle, multikey, multivalue, variable_tracking, common_words, qa (comma-separated).")
]
LengthsOption = Annotated[str, typer.Option(help="Context lengths: 2k, 4k, or token counts (comma-separated).")]
QuestionAwareOption = Annotated[
    bool, typer.Option(help="Compress with the question in the observation window (default: the context alone, then the question).")
]
ArtifactsOption = Annotated[
    Optional[Path], typer.Option(help="Folder of the compiled artifacts (default artifacts/<model>/).")
]


def _command_line(ctx: typer.Context) -> str:
    """The command with every setting spelled out (defaults included), for the reports it writes."""
    parts = ["kvcompile", ctx.info_name]
    for name, value in ctx.params.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts += [flag] if value else []
        elif value is not None:
            parts += [flag, str(value)]
    return " ".join(parts)


def _suite_settings(
    ratios: list[float], tasks: str, lengths: str, samples: int, seed: int, question_aware: bool, new_tokens: int,
    prompt_format: str,
) -> object:
    """The checked suite settings of eval and tune, from their options."""
    from .evaluation.suite_run import SuiteSettings
    from .tasks.suite import parse_lengths

    settings = SuiteSettings(
        ratios=tuple(ratios), tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()),
        lengths=tuple(parse_lengths(lengths)), samples=samples, seed=seed, question_aware=question_aware,
        new_tokens=new_tokens, prompt_format=prompt_format,
    )
    settings.check()
    return settings


@app.command(name="eval")
def eval_(
    ctx: typer.Context,
    model: ModelOption = "default",
    methods: MethodsOption = None,
    ratios: Annotated[str, typer.Option(help="Compression ratios (fraction of the cache removed).")] = "0.5,0.75,0.9",
    tasks: TasksOption = "passkey,needle,multikey,multivalue,variable_tracking,common_words,qa",
    lengths: LengthsOption = "2k",
    samples: Annotated[int, typer.Option(help="Prompts per task and length (facts at depths spread over 0.1-0.9).")] = 3,
    seed: SeedOption = 0,
    question_aware: QuestionAwareOption = False,
    prompt_format: PromptFormatOption = "auto",
    new_tokens: Annotated[int, typer.Option(help="Greedy tokens generated per answer (fidelity compares the first 32).")] = 48,
    artifacts: ArtifactsOption = None,
    out: Annotated[Path, typer.Option(help="Output folder: results.md/.csv, summary.csv, plots, run records.")] = Path("eval_results"),
    resume: Annotated[
        bool, typer.Option(help="Continue an interrupted run of the same settings, or add methods to a finished one.")
    ] = False,
) -> None:
    """Run the long-context suite through each method at each ratio and write accuracy and fidelity tables and plots."""
    with clear_errors() as resources:
        import datetime

        from .evaluation.contestants import artifact_paths, default_methods, parse_methods
        from .evaluation.measure import machine
        from .evaluation.report import write_report
        from .evaluation.store import RunStore
        from .evaluation.suite_run import evaluate

        settings = _suite_settings(
            _numbers(ratios, float), tasks, lengths, samples, seed, question_aware, new_tokens, prompt_format
        )
        ctx.params["methods"] = methods = methods or default_methods()
        contestants = parse_methods(methods)
        paths = artifact_paths(contestants, artifacts or _artifact_folder(model))
        record = {"model": model, "methods": [c.label for c in contestants], **dataclasses.asdict(settings)}
        _claim_output(resources, out, folder=True)
        store = RunStore(out, record, resume, extendable=("methods",))
        loaded, tokenizer = _load(model)
        records = evaluate(loaded, tokenizer, contestants, paths, settings, store)
        header = "\n".join(
            [
                f"# kvcompile eval: {model}",
                "",
                f"Command: `{_command_line(ctx)}`  ",
                f"Machine: {machine()}  ",
                f"Finished: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
                f"{len({r['prompt'] for r in records})} prompts (tasks {', '.join(settings.tasks)}; lengths "
                f"{', '.join(map(str, settings.lengths))}; {samples} per task and length; seed {seed}), "
                f"{'question-aware' if question_aware else 'question-agnostic (the context is compressed before the question is seen)'}, "
                f"greedy, {new_tokens} new tokens.",
                "",
            ]
        )
        for path in write_report(records, out, header):
            typer.echo(f"wrote {path}")
        typer.echo((out / "results.md").read_text().split("## Per method")[0])


@app.command()
def tune(
    model: ModelOption = "default",
    tolerance: Annotated[float, typer.Option(help="Largest accuracy loss against the full cache accepted (0.02 = 2 points).")] = 0.02,
    methods: Annotated[str, typer.Option(help="Runtime methods to tune (comma-separated, options as name:key=value).")] = "compresskv,compilerkv,kvcompose,kvcompress,snapkv",
    ratios: Annotated[str, typer.Option(help="Ratios tried, in increasing order until a method leaves the tolerance.")] = "0.25,0.5,0.6,0.7,0.75,0.8,0.85,0.9",
    tasks: TasksOption = "passkey,needle,multikey,multivalue,variable_tracking,common_words,qa",
    lengths: LengthsOption = "2k",
    samples: Annotated[int, typer.Option(help="Validation prompts per task and length.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the validation prompts (kvcompile eval uses 0 by default).")] = 1,
    question_aware: QuestionAwareOption = False,
    prompt_format: PromptFormatOption = "auto",
    artifacts: ArtifactsOption = None,
    out: Annotated[Optional[Path], typer.Option(help="Output artifact (default artifacts/<model>/tuned_defaults.safetensors).")] = None,
    resume: ResumeOption = False,
) -> None:
    """Pick, per method, the largest compression ratio whose validation accuracy stays within the tolerance of the
    full cache, and write the best as the runtime's default (a tuned_defaults artifact)."""
    started = time.perf_counter()
    with clear_errors() as resources:
        import shutil

        from .evaluation.contestants import artifact_paths, parse_methods
        from .evaluation.store import RunStore
        from .evaluation.tuning import describe_tuning, tune as tune_ratios
        from .plots import plot_tuned_defaults

        settings = _suite_settings(
            sorted(_numbers(ratios, float)), tasks, lengths, samples, seed, question_aware, 48, prompt_format
        )
        if not 0.0 <= tolerance < 1.0:
            raise KVRuntimeError(f"--tolerance {tolerance}: give an accuracy difference in [0, 1)")
        contestants = parse_methods(methods)
        if any(c.kind == "kvpress" for c in contestants):
            raise KVRuntimeError("tune recommends a runtime method: kvpress presses can be compared with kvcompile eval only")
        target = _claim_output(resources, out or _default_artifact(model, "tuned_defaults"))
        folder = artifacts or target.parent
        paths = artifact_paths(contestants, folder)
        records = target.with_name(target.stem + ".runs")
        store = RunStore(records, {"model": model, "methods": [c.label for c in contestants], "tolerance": tolerance,
                                   **dataclasses.asdict(settings)}, resume)
        loaded, tokenizer = _load(model)
        artifact = tune_ratios(loaded, tokenizer, contestants, paths, settings, tolerance, store, target.parent)
        _finish(artifact, target, plot_tuned_defaults, started)
        shutil.rmtree(records)  # the run records are in the artifact now
        typer.echo(describe_tuning(artifact))


def _check_checkpoint_every(items: int) -> None:
    if items < 1:
        raise KVRuntimeError(f"--checkpoint-every {items}: give a number of items of at least 1")


@app.command()
def merge(
    partials: Annotated[list[Path], typer.Argument(help="Partial statistics written by `--shard i/n` jobs.")],
    out: Annotated[Path, typer.Option(help="Output: the finished artifact, or partial statistics if shards are missing.")],
) -> None:
    """Add up the partial statistics of separate jobs (heads, budgets, stats) into the artifact one run would write."""
    started = time.perf_counter()
    with clear_errors() as resources:
        from kvruntime.artifact import load_artifact

        from .attention_stats import finish_attention_stats
        from .budgets import finish_layer_budgets
        from .heads import finish_head_scores
        from .partial_statistics import PARTIAL_KIND, merge_partials
        from .plots import plot_head_scores, plot_kvcompose_stats, plot_layer_budgets

        recipes = {
            "srh_heads": (finish_head_scores, plot_head_scores),
            "layer_budgets": (finish_layer_budgets, plot_layer_budgets),
            "kvcompose_stats": (finish_attention_stats, plot_kvcompose_stats),
        }
        if out.resolve() in {path.resolve() for path in partials}:
            raise KVRuntimeError(f"--out {out} is one of the partials being merged: give another file")
        _claim_output(resources, out)
        loaded = [load_artifact(path, kind=PARTIAL_KIND) for path in partials]
        artifact = merge_partials(loaded, {kind: finish for kind, (finish, _) in recipes.items()})
        _finish(artifact, out, recipes[artifact.kind][1] if artifact.kind in recipes else None, started)


def describe_tables(artifact: object) -> str:
    """A few lines on what was learned: how far each table is from flat, and how the rounds went."""
    t = artifact.tensors
    heads, gate = t["head_reliability"], t["risk_thresholds"]
    changes = t["round_changes"].tolist()
    return "\n".join(
        [
            f"W_head: {int((heads != 1.0).sum())} of {heads.numel()} entries away from 1.0, range "
            f"{float(heads.min()):.3f}-{float(heads.max()):.3f}; states with records: "
            f"{int((t['head_support'] > 0).sum())} of {heads.numel()}",
            f"T_gate: {len(gate.unique())} distinct thresholds, range {float(gate.min()):.3f}-{float(gate.max()):.3f}; "
            f"cells with records: {int((t['gate_support'] > 0).sum())} of {gate.numel()}",
            "share of entries changed per round (head, gate): "
            + (", ".join(f"({h:.2f}, {g:.2f})" for h, g in changes) or "relearned from experience"),
        ]
    )


@app.command()
def info(path: Annotated[Path, typer.Argument(help="Artifact file (.safetensors).")]) -> None:
    """Print an artifact's kind, model, tensors and metadata; refuse a file that is not a valid artifact."""
    with clear_errors():
        from kvruntime.artifact import check_tensors, read_artifact

        artifact = read_artifact(path)
        check_tensors(artifact)  # the schema the runtime checks: info lists only what generate would accept
        typer.echo(f"{path}: {artifact.kind} artifact")
        model = artifact.model
        typer.echo(
            f"model: {model.architecture}, {model.num_layers} layers, {model.num_query_heads} query heads, "
            f"{model.num_kv_heads} KV heads, head dim {model.head_dim}, weights {model.weights_hash}"
        )
        typer.echo("tensors:")
        for name, tensor in sorted(artifact.tensors.items()):
            typer.echo(f"  {name}: {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}")
        typer.echo("provenance: " + json.dumps(artifact.provenance, indent=2, sort_keys=True))
        typer.echo("params: " + json.dumps(artifact.params, indent=2, sort_keys=True))


if __name__ == "__main__":
    app()
