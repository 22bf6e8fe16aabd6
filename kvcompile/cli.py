"""The `kvcompile` command line: options into settings, then the recipe (`kvcompile/recipe.py`) or the runtime.

Nothing heavy is imported before the options are checked: bad input is refused in one line before torch loads."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import shlex
import signal
import sys
import typing
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Annotated

import typer

from kvcompile import recipe
from kvcompile.recipe import artifact_folder, claim_output, compile_artifact, default_artifact
from kvruntime import KVRuntimeError
from kvruntime.errors import printable
from kvruntime.registry import COMPARED_NAMES, methods_help

app = typer.Typer(
    help="Compile KV-cache compression artifacts for a model, and run compressed generation. "
    f"Runtime methods: {methods_help()}.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelOption = Annotated[
    str, typer.Option(help="'default' (SmolLM2-135M-Instruct), a local model directory, or a cached hub id.")
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


def _numbers(text: str, convert: type) -> tuple:
    try:
        return tuple(convert(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise KVRuntimeError(f"expected comma-separated {convert.__name__} values, got {text!r}") from None


def _read_text(path: Path, what: str = "prompt file") -> str:
    """A UTF-8 text file's text; `what` names it in the one-line refusals."""
    if path.is_dir():
        raise KVRuntimeError(f"{what} {path} is a folder: give a text file")
    if not path.exists():
        raise KVRuntimeError(f"{what} {path} does not exist")
    if not path.is_file():
        raise KVRuntimeError(f"{what} {path} is not a regular file (a device or a pipe): give a text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KVRuntimeError(f"{what} {path} is not UTF-8 text") from None
    if not text.strip():
        raise KVRuntimeError(f"{what} {path} is empty")
    return text


def _read_prompts(paths: list[Path]) -> list[tuple[str, str]]:
    """(name, text) of every prompt: a text file is one prompt ("prompt file <path>"); a .jsonl file holds one per
    line, as a JSON string or an object with a "prompt" string ("prompt <path>:<line>")."""
    prompts = []
    for path in paths:
        text = _read_text(path)
        if path.suffix != ".jsonl":
            prompts.append((f"prompt file {path}", text))
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (ValueError, RecursionError) as exc:  # a number past Python's digits, nesting past its stack
                why = "is not JSON" if isinstance(exc, json.JSONDecodeError) else "is JSON past Python's limits"
                raise KVRuntimeError(f"line {number} of {path} {why}: give one prompt per line") from None
            prompt = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(prompt, str) or not prompt.strip():
                raise KVRuntimeError(
                    f'line {number} of {path} holds no prompt: write a JSON string or {{"prompt": "..."}}'
                )
            check_encodable(f"line {number} of {path}", prompt)
            prompts.append((f"prompt {path}:{number}", prompt))
    return prompts


def check_encodable(what: str, text: str) -> None:
    """Refuse text that is not Unicode a tokenizer can take: a lone surrogate (a JSON escape, or bytes of another
    encoding on the command line)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise KVRuntimeError(f"{what} holds a lone surrogate (not Unicode text): give UTF-8 text") from None


# Over three times the default model's longest token (81 bytes: a newline and 80 spaces); byte-level BPE merges stay
# short. A prompt of more bytes than this times the model's positions cannot fit, whatever it says.
MAX_TOKEN_BYTES = 256


def check_prompt_bytes(name: str, text: str, limit: int | None) -> None:
    """Refuse, before tokenizing it, a prompt too long in bytes to fit in `limit` positions."""
    size = len(text.encode("utf-8"))
    if limit is not None and size > MAX_TOKEN_BYTES * limit:
        raise KVRuntimeError(
            f"{name} is {size:,} bytes: more than the model's {limit:,} positions can hold (at most "
            f"{MAX_TOKEN_BYTES} bytes per token)"
        )


@app.command()
def generate(
    prompt_file: Annotated[
        list[Path],
        typer.Option(
            help="Text file holding the prompt (the context in question mode). Repeat it for several prompts, or "
            'give a .jsonl file of prompts (a JSON string or {"prompt": ...} per line).'
        ),
    ],
    method: Annotated[
        str | None,
        typer.Option(
            help=f"{methods_help()}. Default: the method and ratio of "
            "artifacts/<model>/tuned_defaults.safetensors (`kvcompile tune`) if there is one, else kvcompress."
        ),
    ] = None,
    ratio: Annotated[
        float | None, typer.Option(help="Fraction of cache entries removed, in [0, 1) (default 0.5).")
    ] = None,
    budget: Annotated[int | None, typer.Option(help="Tokens kept per layer (instead of --ratio).")] = None,
    question: Annotated[
        list[str] | None,
        typer.Option(help="Question mode: compress the prompt without the question, then answer each --question."),
    ] = None,
    memory: Annotated[str, typer.Option(help="padded (default) or masked: how per-head counts are stored.")] = "padded",
    artifact: Annotated[
        list[Path] | None,
        typer.Option(
            help="Compiled artifact(s), or a bundle (its folder or hub repo id, from `kvcompile bundle`), checked "
            "against the model."
        ),
    ] = None,
    force: Annotated[bool, typer.Option(help="Apply artifacts of another checkpoint of the same shape.")] = False,
    nearest_budget: Annotated[
        bool,
        typer.Option(
            help="compilerkv: use the tables of the nearest compiled budget for a --budget not compiled (a --ratio always does)."
        ),
    ] = False,
    option: Annotated[
        list[str] | None,
        typer.Option(help="A method option as key=value, e.g. mode=dynamic or unstructured=true for kvcompose."),
    ] = None,
    model: ModelOption = "default",
    prompt_format: PromptFormatOption = "auto",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 32,
    prefill_chunk_size: Annotated[
        int | None,
        typer.Option(
            help="Feed the prompt in chunks of this many tokens, every layer cut to its budget after each: the cache "
            "held never exceeds the budgets plus one chunk (methods whose layer budgets are known in advance)."
        ),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option(
            help="Prompts generated together (left-padded): each row is compressed as it would be alone, and the "
            "batch decodes at once."
        ),
    ] = 1,
) -> None:
    """Generate from prompt files with a compressed KV cache, then print the compression report (per batch of
    several prompts: each row's and the batch's bytes held). A prompt is the user's turn of the model's chat
    template (`--prompt-format auto`, for instruct models) or raw text."""
    with clear_errors():
        from kvcompile.prompt_format import check_prompt_format
        from kvruntime import ARTIFACT_KINDS, Request
        from kvruntime.artifact_header import header_kind, header_params, read_header
        from kvruntime.bundle import artifact_files, beside
        from kvruntime.model_spec import check_model_spec, check_positions, position_limit
        from kvruntime.request import check_method_options, parse_option_pairs, required_artifact_kinds
        from kvruntime.serving import check_has_artifact, check_serves

        prompts = _read_prompts(prompt_file)
        if batch_size < 1:
            raise KVRuntimeError(f"--batch-size {batch_size}: give at least 1 prompt per batch")
        check_prompt_format(prompt_format)
        check_model_spec(model)
        positions = position_limit(model)  # from the model's config, read once
        if max_new_tokens < 1:
            raise KVRuntimeError(f"--max-new-tokens {max_new_tokens}: give at least 1 token to generate")
        check_positions(max_new_tokens, positions, f"--max-new-tokens {max_new_tokens}")
        for name, text in prompts:
            check_prompt_bytes(name, text, positions)
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise KVRuntimeError(f"--prefill-chunk-size {prefill_chunk_size}: give a positive number of tokens")
        if question is not None and not all(text.strip() for text in question):
            raise KVRuntimeError("--question is empty: give the text of each question")
        for text in question or []:
            check_encodable("--question", text)
        options = parse_option_pairs(option or [])
        if options and method is None:
            raise KVRuntimeError("--option needs --method: options belong to a method")
        if method is not None:
            options = check_method_options(method, options)
        if nearest_budget:
            options["nearest_budget"] = True
        paths = artifact_files(artifact or [])  # a bundle (folder or hub id) gives its artifacts
        if budget is not None:
            check_positions(budget, positions, f"--budget {budget} tokens per layer")
        tuned: list[Path] = []
        served = None  # (method, its artifacts, its options): what is checked before torch loads
        if method is None:
            # A tuned_defaults artifact (given, or the model's default one) gives `compress` its method and ratio.
            default = default_artifact(model, "tuned_defaults")
            paths = paths or ([default] if default.exists() else [])
            tuned = [p for p in paths if header_kind(p) == "tuned_defaults"]
            recommended = header_params(tuned[0]).get("recommended") if tuned else None
            if isinstance(recommended, dict) and isinstance(recommended.get("method"), str):
                beside_tuned = beside(tuned[0], recommended.get("artifacts") or [], "its recommendation")
                # --nearest-budget goes to the tuned method: checked against it here, as `compress` applies it.
                served = recommended["method"], beside_tuned, {**(recommended.get("options") or {}), **options}
        if not tuned and ratio is None and budget is None:
            ratio = 0.5
        if method is not None:
            kinds = required_artifact_kinds(method, options)
            if paths:  # the artifacts given must hold what the method needs, as `compress` requires
                given = {read_header(path).get("kind") for path in paths}
                for kind in kinds:
                    check_has_artifact(method, kind, given)
            else:
                paths = [default_artifact(model, kind) for kind in kinds]
                for kind, path in zip(kinds, paths):
                    if not path.exists():
                        command = ARTIFACT_KINDS[kind].command
                        raise KVRuntimeError(
                            f"method {method!r} needs {path}: compile it with `{command}` or pass --artifact"
                        )
            served = method, paths, options
        request = Request(ratio, budget, memory) if ratio is not None or budget is not None else None
        if served is not None:
            # A request the method cannot serve is refused here, before torch loads.
            check_serves(*served, [request] if request else [], prefill_chunk_size, memory)
        if method is not None:
            from kvruntime.methods import check_method_serves

            # The artifacts' tensors are checked too before the model loads.
            check_method_serves(method, paths, options, [request], prefill_chunk_size)
        import kvruntime
        from kvcompile.prompt_format import chat_frame, uses_chat

        loaded, tokenizer = recipe.load_model(model)
        tokenizer.model_max_length = sys.maxsize  # the prompts' check below refuses one past the positions, in one line
        chat = uses_chat(tokenizer, prompt_format)
        turn_start, turn_end = chat_frame(tokenizer) if chat else ("", "")

        def encode(text: str, special: bool = False):
            return tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids

        from kvruntime.batch_rows import left_pad

        # A batch's padding token: the tokenizer's own, else its end of text (most causal LMs have no pad token).
        pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
        greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        limit = getattr(loaded.config, "max_position_embeddings", None)
        # Chat: a prompt is the user's turn, stripped as a chat front end sends it; raw: the text as it is.
        contexts = [(name, text.strip() if chat else text) for name, text in prompts]
        # Every prompt's ids, checked before the first is answered: a batch is refused whole or answered whole.
        # Question mode: the context inside the user's turn, then per question its ids after that context.
        encoded = []
        for name, context in contexts:
            if encode(context).shape[1] < 2:
                raise KVRuntimeError(f"{name} holds fewer than 2 tokens: nothing to compress")
            if question:
                row = encode(turn_start + context, special=not chat)[0]
                separator = "\n\n" if chat else ("" if context[-1].isspace() else "\n")
                asked = [encode(separator + text.strip() + turn_end)[0] for text in question]
            else:
                row, asked = encode(turn_start + context + turn_end, special=not chat)[0], []
            tokens = len(row) + max((len(ids) for ids in asked), default=0)
            check_positions(tokens + max_new_tokens, limit, f"{name} ({tokens} tokens) and {max_new_tokens} new tokens")
            encoded.append((name, row, asked))

        def show(name: str, text: str) -> None:
            if len(encoded) > 1:
                typer.echo(f"== {name}")
            typer.echo(text)

        with kvruntime.compress(
            loaded,
            method,
            ratio=ratio,
            budget=budget,
            memory=memory,
            artifacts=paths,
            force=force,
            options=options,
            prefill_chunk_size=prefill_chunk_size,
        ) as session:
            for first in range(0, len(encoded), batch_size):
                batch = encoded[first : first + batch_size]
                ids, mask = left_pad([row for _, row, _ in batch], pad)
                if question:
                    compressed = session.prefill(ids, attention_mask=mask)
                    answers = [[] for _ in batch]
                    for number, text in enumerate(question):
                        question_ids, question_mask = left_pad([asked[number] for _, _, asked in batch], pad)
                        output = compressed.generate(question_ids, attention_mask=question_mask, **greedy)
                        for lines, answer in zip(answers, output[:, question_ids.shape[1] :]):
                            decoded = tokenizer.decode(answer, skip_special_tokens=True).strip()
                            lines.append(f"Q: {text.strip()}\nA: {decoded}")
                    for (name, _, _), lines in zip(batch, answers):
                        show(name, "\n".join(lines))
                else:
                    output = loaded.generate(input_ids=ids, attention_mask=mask, **greedy)
                    for (name, _, _), answer in zip(batch, output[:, ids.shape[1] :]):
                        show(name, tokenizer.decode(answer, skip_special_tokens=True).strip())
                typer.echo(str(session.batch_report if len(batch) > 1 else session.report))


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
PromptsOption = Annotated[int, typer.Option(help="Calibration prompts.")]
DeviceOption = Annotated[
    str,
    typer.Option(help="Where the model runs: cpu, cuda (under torchrun: each rank's cuda:LOCAL_RANK), cuda:N, mps."),
]
DtypeOption = Annotated[str, typer.Option(help="The model's dtype: float32, bfloat16 or float16.")]
PromptTokensOption = Annotated[int, typer.Option(help="Tokens per calibration prompt.")]


def _artifact_out(kind: str) -> object:
    """The --out option of a command that writes a `kind` artifact."""
    return Annotated[Path | None, typer.Option(help=f"Output artifact (default artifacts/<model>/{kind}.safetensors).")]


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
ArtifactsOption = Annotated[
    Path | None,
    typer.Option(
        help="Folder of the compiled artifacts, or a bundle's folder or hub repo id (default artifacts/<model>/)."
    ),
]


# The commands that write an artifact (what `reproduce` may run), each with its parameters that read a file or folder.
COMPILE_COMMANDS: dict[str, frozenset[str]] = {}


def _reads_path(hint: object) -> bool:
    """Whether an option annotated `hint` (`Annotated[Path | None, ...]`) takes a path."""
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    return base is Path or Path in typing.get_args(base)


def compile_command(kind: str, shardable: bool = False, checkpoint_every: int = 4) -> Callable:
    """Register a compile command. The decorated function takes the command's own options (and `model` or `out`
    if it needs them) and returns (recipe, settings); the options every compile command shares (--model, --out,
    --resume, --device, --dtype, and for recipes that split their work --shard and --checkpoint-every) are declared
    here once, and the command runs `compile_artifact` with them, refusing bad input in one line."""
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

    def register(build: Callable) -> Callable:
        hints = typing.get_type_hints(build, include_extras=True)
        wanted = inspect.signature(build).parameters
        keyword = inspect.Parameter.KEYWORD_ONLY
        own = [inspect.Parameter(n, keyword, default=p.default, annotation=hints[n]) for n, p in wanted.items()]
        own = [p for p in own if p.name not in shared]

        def command(ctx: typer.Context, **params: object) -> None:
            job = {name: params.pop(name) for name in shared}
            with clear_errors() as resources:
                recipe_, settings = build(**params, **{name: job[name] for name in ("model", "out") if name in wanted})
                rerun = command_line(ctx, leave_out=recipe.OUTPUT_OPTIONS)
                compile_artifact(recipe_, settings, resources=resources, echo=typer.echo, command=rerun, **job)

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = inspect.Signature(
            [context, *own] + [inspect.Parameter(n, keyword, default=d, annotation=a) for n, (a, d) in shared.items()]
        )
        command.__name__, command.__doc__ = build.__name__, build.__doc__
        app.command()(command)
        COMPILE_COMMANDS[build.__name__] = frozenset(p.name for p in own if _reads_path(p.annotation))
        return build

    return register


@compile_command("srh_heads", shardable=True, checkpoint_every=8)
def heads(
    corpus: CorpusOption = None,
    lengths: Annotated[str, typer.Option(help="Probe context lengths in tokens.")] = "512,1024,1536,2048",
    depths: Annotated[
        str, typer.Option(help="Needle depths (0 = start, 1 = end).")
    ] = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
    prompt_format: Annotated[str, typer.Option(help="chat (the model's chat template) or raw (base models).")] = "chat",
    seed: SeedOption = 0,
) -> tuple:
    """Score every query head as a Semantic Retrieval Head (and a classic retrieval head) on needle probes."""
    from kvcompile.recipes.compresskv.recipe import HeadsRecipe
    from kvcompile.recipes.compresskv.settings import HeadsSettings

    if prompt_format not in ("chat", "raw"):
        raise KVRuntimeError(f"--prompt-format {prompt_format!r}: use chat or raw")
    return HeadsRecipe(corpus), HeadsSettings(
        _numbers(lengths, int), _numbers(depths, float), seed, prompt_format == "chat"
    )


@compile_command("layer_budgets", shardable=True)
def budgets(
    model: str,
    heads_artifact: Annotated[
        Path | None,
        typer.Option("--heads", help="srh_heads artifact (default artifacts/<model>/srh_heads.safetensors)."),
    ] = None,
    corpus: CorpusOption = None,
    prompts: PromptsOption = 24,
    prompt_tokens: PromptTokensOption = 1024,
    new_tokens: Annotated[int, typer.Option(help="Greedy decoding steps measured per prompt.")] = 32,
    seed: SeedOption = 0,
) -> tuple:
    """Measure each layer's compression error and write the inputs of the error-aware layer budgets."""
    from kvcompile.recipes.compresskv.recipe import BudgetsRecipe
    from kvcompile.recipes.compresskv.settings import BudgetsSettings

    heads = heads_artifact or default_artifact(model, "srh_heads")
    return BudgetsRecipe(corpus, heads), BudgetsSettings(prompts, prompt_tokens, new_tokens, seed)


@compile_command("compilerkv_tables")
def tables(
    budgets: Annotated[
        str, typer.Option(help="Budgets (tokens per layer, window included) to compile tables for.")
    ] = "256,512",
    corpus: CorpusOption = None,
    rounds: Annotated[int, typer.Option(help="At most this many rounds of head then gate learning.")] = 2,
    prompts: Annotated[int, typer.Option(help="Calibration prompts (context + continuation).")] = 32,
    candidates: Annotated[
        int,
        typer.Option(
            help="Candidate prompts whose risk is measured; --prompts of them are chosen across the risk cells."
        ),
    ] = 64,
    context: Annotated[int, typer.Option(help="Tokens of context per calibration prompt.")] = 2048,
    continuation: Annotated[int, typer.Option(help="Tokens of continuation whose NLL is the reward.")] = 128,
    seed: SeedOption = 0,
    elastic: Annotated[
        bool,
        typer.Option(
            help="Learn for the paper's elastic gate (a layer keeps only tokens above its threshold) instead of the "
            "ratio-honest runtime default (the layers share the budget)."
        ),
    ] = False,
    utility: Annotated[
        str,
        typer.Option(
            help="The stabilized utility the weights act on: global (the spec's: one attention mass for every head) "
            "or head (each query head's own window attention averaged with it, so every head's weight matters; "
            "the default: more signal per probe and a lower loss, benchmarks/compilerkv/compilerkv_reward_noise.md)."
        ),
    ] = "head",
    design: Annotated[
        str,
        typer.Option(
            help="The experience design: sampled (a few states per prompt, many actions: the paper's shape) or "
            "every-state (every head and layer probed on every prompt with weights 1.0/1.5 and thresholds "
            "0.8/0.9/1.0 from neutral tables: as many records per state as prompts)."
        ),
    ] = "sampled",
    loss: Annotated[
        str,
        typer.Option(
            help="The rollouts' loss: nll (the continuation's NLL, the paper's reward) or kl (its KL divergence "
            "from the full cache's next-token distributions: the same expectation, about half the noise)."
        ),
    ] = "nll",
    continuation_from: Annotated[
        str,
        typer.Option(help="Whose continuation is scored: corpus (the text's own) or greedy (the full-cache model's)."),
    ] = "corpus",
    entropy_bins: Annotated[
        int, typer.Option(help="Entropy bins of the risk gate (1 with --perplexity-bins 1: one threshold per layer).")
    ] = 20,
    perplexity_bins: Annotated[int, typer.Option(help="Window-perplexity bins of the risk gate.")] = 4,
    from_experience: Annotated[
        Path | None, typer.Option(help="Relearn the tables from a stored compilerkv_experience artifact (no rollouts).")
    ] = None,
) -> tuple:
    """Learn CompilerKV's head-reliability and risk-threshold tables (offline contextual bandits, DiscreteCQL)."""
    from kvcompile.recipes.compilerkv.recipe import TablesRecipe
    from kvcompile.recipes.compilerkv.settings import DESIGNS, TablesSettings

    if design not in DESIGNS:
        raise KVRuntimeError(f"--design {design!r}: choose one of {', '.join(DESIGNS)}")
    settings = TablesSettings(
        budgets=_numbers(budgets, int), prompts=prompts, candidates=candidates, context=context,
        continuation=continuation, rounds=rounds, seed=seed, elastic=elastic, utility=utility, loss=loss,
        continuation_from=continuation_from, entropy_bins=entropy_bins, perplexity_bins=perplexity_bins,
        design=DESIGNS[design],
    )  # fmt: skip
    return TablesRecipe(corpus, from_experience), settings


@compile_command("kvcompose_stats", shardable=True)
def stats(
    corpus: CorpusOption = None,
    task_set: Annotated[
        Path | None,
        typer.Option(help="Task-aware mode: a text file of downstream prompts, one per line (default: task-agnostic)."),
    ] = None,
    ratios: Annotated[
        str,
        typer.Option(
            help="Target compression ratios to compile the allocation for (others in between are interpolated)."
        ),
    ] = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.75,0.8,0.85,0.9,0.95",
    prompts: PromptsOption = 24,
    prompt_tokens: PromptTokensOption = 2048,
    seed: SeedOption = 0,
) -> tuple:
    """Measure KVCompose's attention statistics: composite-token curves and the layer allocation per ratio."""
    from kvcompile.recipes.kvcompose.recipe import StatsRecipe
    from kvcompile.recipes.kvcompose.settings import StatsSettings

    settings = StatsSettings(ratios=_numbers(ratios, float), prompts=prompts, prompt_tokens=prompt_tokens, seed=seed)
    return StatsRecipe(corpus, task_set), settings


@compile_command("distilled_scorer", shardable=True)
def distill(
    corpus: CorpusOption = None,
    oracle: Annotated[
        str,
        typer.Option(
            help="The second pass distilled: reconstruction (the context again), repeat (behind an instruction) "
            "or kvzip_plus (KVzap's output-weighted attention, behind the instruction)."
        ),
    ] = "reconstruction",
    student: Annotated[
        str,
        typer.Option(
            help="The features the student reads: all (attention input, position, first token, likeness) or hidden "
            "(KVzap's: the attention input and a bias; exportable to kvpress's KVzapModel)."
        ),
    ] = "all",
    prompts: Annotated[
        int, typer.Option(help="Calibration prompts (every 4th held out to choose the ridge strength).")
    ] = 32,
    prompt_tokens: PromptTokensOption = 2048,
    seed: SeedOption = 0,
) -> tuple:
    """Distil a one-pass token scorer from a second pass over calibration prompts (ridge regression per layer)."""
    from kvcompile.calibration.corpus import REPEATING_CORPUS
    from kvcompile.recipes.distilled.recipe import DistillRecipe
    from kvcompile.recipes.distilled.settings import DistillSettings

    settings = DistillSettings(prompts=prompts, prompt_tokens=prompt_tokens, oracle=oracle, student=student, seed=seed)
    return DistillRecipe(corpus or REPEATING_CORPUS), settings


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
) -> object:
    """The suite settings of eval and tune, from their options."""
    from kvcompile.evaluation.settings import SuiteSettings
    from kvcompile.tasks.grid import parse_lengths, parse_tasks

    task_names, task_samples = parse_tasks(tasks)
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
    )


@app.command(name="eval")
def eval_(
    ctx: typer.Context,
    model: ModelOption = "default",
    methods: MethodsOption = None,
    ratios: Annotated[str, typer.Option(help="Compression ratios (fraction of the cache removed).")] = "0.5,0.75,0.9",
    tasks: TasksOption = "passkey,needle,multikey,multivalue,variable_tracking,common_words,qa",
    lengths: LengthsOption = "2k",
    samples: Annotated[
        int, typer.Option(help="Prompts per task and length (facts at depths spread over 0.1-0.9).")
    ] = 3,
    seed: SeedOption = 0,
    question_aware: QuestionAwareOption = False,
    prompt_format: PromptFormatOption = "auto",
    new_tokens: Annotated[
        int, typer.Option(help="Greedy tokens generated per answer (fidelity compares the first 32).")
    ] = 48,
    artifacts: ArtifactsOption = None,
    out: Annotated[Path, typer.Option(help="Output folder: results.md/.csv, summary.csv, plots, run records.")] = Path(
        "eval_results"
    ),
    resume: Annotated[
        bool, typer.Option(help="Continue an interrupted run of the same settings, or add methods to a finished one.")
    ] = False,
    batch_size: Annotated[
        int,
        typer.Option(
            help="Prompts a kvcompile method answers at once (each compressed as alone; peak memory is then not "
            "measured per prompt). The full cache and kvpress's presses answer one by one."
        ),
    ] = 1,
    shared_prefill: Annotated[
        bool,
        typer.Option(
            "--shared-prefill/--own-prefills",
            help="Prefill each context once with the full cache and cut every method's cache from that forward (the "
            "same records, several times faster: each method's prefill time is the shared forward plus its own "
            "scoring and cut, and peak memory is not measured); streamed prompts and presses with passes of their "
            "own still prefill alone. --own-prefills gives every method its own prefill, timed and measured.",
        ),
    ] = True,
    device: DeviceOption = "cpu",
) -> None:
    """Run the long-context suite through each method at each ratio and write accuracy and fidelity tables and plots."""
    with clear_errors() as resources:
        import datetime

        from kvcompile.evaluation.contestants import artifact_paths, check_contestants, default_methods, parse_methods
        from kvcompile.evaluation.store import RunStore
        from kvruntime.model_spec import check_model_spec, position_limit

        check_model_spec(model)
        recipe.check_device_name(device)
        settings = _suite_settings(
            _numbers(ratios, float), tasks, lengths, samples, seed, question_aware, new_tokens, prompt_format
        )
        settings.check()
        settings.check_positions(position_limit(model))
        if batch_size < 1:
            raise KVRuntimeError(f"--batch-size {batch_size}: give at least 1 prompt per batch")
        ctx.params["methods"] = methods = methods or default_methods()
        contestants = parse_methods(methods)
        paths = artifact_paths(contestants, artifacts or artifact_folder(model))
        check_contestants(contestants, paths, settings.ratios)
        record = {"model": model, "methods": [c.label for c in contestants], **dataclasses.asdict(settings)}
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
        header = "\n".join(
            [
                f"# kvcompile eval: {model}",
                "",
                f"Command: `{command_line(ctx)}`  ",
                f"Machine: {machine()}  ",
                f"Finished: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
                f"{len({r['prompt'] for r in records})} prompts (tasks {', '.join(settings.tasks)}; lengths "
                f"{', '.join(map(str, settings.lengths))}; {_samples_text(settings)}; seed {seed}), "
                f"{'question-aware' if question_aware else 'question-agnostic (the context is compressed before the question is seen)'}, "
                f"greedy, {new_tokens} new tokens.",
                "",
            ]
        )
        subject = contestants[1].label if len(contestants) > 1 else None  # the first method after the full cache
        written, summary = write_report(records, out, header, subject)
        for path in written:
            typer.echo(f"wrote {path}")
        typer.echo(summary)


@compile_command("tuned_defaults")
def tune(
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
    question_aware: QuestionAwareOption = False,
    prompt_format: PromptFormatOption = "auto",
    artifacts: ArtifactsOption = None,
) -> tuple:
    """Pick, per method, the largest compression ratio whose validation accuracy stays within the tolerance of the
    full cache, and write the best as the runtime's default (a tuned_defaults artifact)."""
    from kvcompile.recipes.tuned_defaults.recipe import TuneRecipe
    from kvcompile.recipes.tuned_defaults.settings import TuneSettings

    suite = _suite_settings(
        tuple(sorted(_numbers(ratios, float))), tasks, lengths, samples, seed, question_aware, 48, prompt_format
    )
    target = out or default_artifact(model, "tuned_defaults")  # where compile_artifact writes it
    records = target.with_name(target.stem + ".runs")
    return TuneRecipe(methods, artifacts or target.parent, records, model), TuneSettings(suite, tolerance)


@app.command()
def merge(
    partials: Annotated[list[Path], typer.Argument(help="Partial statistics written by `--shard i/n` jobs.")],
    out: Annotated[
        Path, typer.Option(help="Output: the finished artifact, or partial statistics if shards are missing.")
    ],
) -> None:
    """Add up the partial statistics of separate jobs (heads, budgets, stats) into the artifact one run would write."""
    with clear_errors() as resources:
        import time

        from kvcompile.recipe import PARTIAL_KIND, claim_artifact
        from kvruntime.artifact_header import header_params, read_header

        started = time.perf_counter()
        if out.resolve() in {path.resolve() for path in partials}:
            raise KVRuntimeError(f"--out {out} is one of the partials being merged: give another file")
        statistics_of = set()
        for path in partials:
            if read_header(path).get("kind") != PARTIAL_KIND:
                raise KVRuntimeError(f"{path} is not partial statistics (written by a `--shard i/n` job)")
            statistics_of.add(str(header_params(path).get("statistics_of")))
        claim_artifact(resources, out, {PARTIAL_KIND, *statistics_of})

        from kvcompile.calibration.distributed import Shard
        from kvcompile.calibration.partial_statistics import merge_partials
        from kvcompile.recipe import read_run_record, write_result
        from kvcompile.recipes import RECIPES
        from kvruntime import load_artifact

        loaded = [load_artifact(path, kind=PARTIAL_KIND) for path in partials]
        shardable = {kind: recipe_type() for kind, recipe_type in RECIPES.items() if recipe_type.shardable}
        artifact = merge_partials(loaded, {kind: shardable[kind].finish for kind in shardable})
        merged_from = {
            "merged_from": [str(path) for path in partials],
            "shard_compile_seconds": [read_run_record(path).get("compile_seconds") for path in partials],
        }
        write_result(shardable.get(artifact.kind), artifact, out, started, Shard(), typer.echo, merged_from)


@app.command()
def info(
    path: Annotated[
        Path, typer.Argument(help="Artifact file (.safetensors), or a bundle (its folder or hub repo id).")
    ],
) -> None:
    """Print an artifact's kind, model, tensors and metadata, or a bundle's artifacts; refuse a file that is not a
    valid artifact and a bundle whose files do not match its manifest."""
    with clear_errors():
        from kvruntime.bundle import locate, read_bundle

        folder = locate(path)  # a hub repo id is looked up once
        if folder.is_dir():
            from kvcompile.bundle import describe_bundle

            for line in describe_bundle(read_bundle(folder)):
                typer.echo(line)
            return
        from kvruntime.artifact_header import read_header

        read_header(path)  # a missing file or one that is not an artifact is refused before torch loads
        from kvcompile.recipe import read_run_record
        from kvruntime import read_artifact
        from kvruntime.artifact import check_tensors

        artifact = read_artifact(path)
        check_tensors(artifact)  # the schema the runtime checks: info lists only what generate would accept
        typer.echo(f"{path}: {artifact.kind} artifact")
        typer.echo(f"model: {artifact.model.describe()}")
        typer.echo("tensors:")
        for name, tensor in sorted(artifact.tensors.items()):
            typer.echo(f"  {name}: {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}")
        typer.echo("provenance: " + json.dumps(artifact.provenance, indent=2, sort_keys=True))
        typer.echo("params: " + json.dumps(artifact.params, indent=2, sort_keys=True))
        run = read_run_record(path)
        if run:
            typer.echo("run: " + json.dumps(run, indent=2, sort_keys=True))


@app.command()
def bundle(
    sources: Annotated[
        list[Path], typer.Argument(help="Artifact files, or folders of artifacts (every artifact in them).")
    ],
    out: Annotated[Path, typer.Option(help="The bundle folder to write (replaced if it is a bundle).")],
    base_model: Annotated[
        str | None,
        typer.Option(help="The model's hub id for the card (default: from the artifacts' --model, if a hub id)."),
    ] = None,
    results: Annotated[
        Path | None, typer.Option(help="A markdown file of measured results to put in the model card.")
    ] = None,
) -> None:
    """Write a bundle: the artifacts of one model, a manifest (sha256, command, calibration data, library versions
    of each) and a model card (README.md with hub metadata), loadable by its folder or as a hub repo."""
    with clear_errors() as resources:
        from kvcompile.bundle import bundle_sources, check_bundle_output, write_bundle

        files = bundle_sources(sources)
        check_bundle_output(out, sources)
        claim_output(resources, out, folder=True)
        text = _read_text(results, "--results") if results is not None else None
        manifest = write_bundle(files, out, base_model, text)
        kinds = ", ".join(entry["kind"] for entry in manifest["artifacts"])
        typer.echo(f"wrote {out}: {kinds}, manifest.json, README.md")


def can_ask() -> bool:
    """Whether a person can answer a question (standard input is a terminal)."""
    return sys.stdin.isatty()


def compile_commands() -> dict[str, object]:
    """What `reproduce` may run: each compile command's options (`kvcompile.bundle.CompileCommand`)."""
    from kvcompile.bundle import CompileCommand

    group = typer.main.get_command(app)
    commands = {}
    for name, paths in COMPILE_COMMANDS.items():
        params = group.commands[name].params
        options = {option: p.name for p in params for option in (*p.opts, *p.secondary_opts)}
        flags = {option for p in params if p.is_flag for option in (*p.opts, *p.secondary_opts)}
        commands[name] = CompileCommand(options, frozenset(flags), paths)
    return commands


@app.command()
def reproduce(
    path: Annotated[Path, typer.Argument(help="A bundle (its folder or hub repo id).")],
    only: Annotated[
        list[str] | None, typer.Option(help="Reproduce only the artifacts of this kind (repeatable).")
    ] = None,
    work: Annotated[Path | None, typer.Option(help="Where the scratch folder goes (default: the system's).")] = None,
    model: Annotated[
        str | None, typer.Option(help="The model to use where a recorded command names a local model folder.")
    ] = None,
    corpus: Annotated[
        str | None, typer.Option(help="The corpus to use where a recorded command names a corpus file or folder.")
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Run the commands shown without asking.")] = False,
) -> None:
    """Rerun the compile command recorded for each of a bundle's artifacts and compare the bytes with the bundle's.
    It shows the commands and asks first; each reads only the bundle's files, the data shipped with kvcompile, the
    default model or a cached hub model, and what --model and --corpus name. Exit code 1 when one differs."""
    with clear_errors():
        from kvcompile.bundle import check_kinds
        from kvcompile.bundle import reproduce as rerun
        from kvruntime.bundle import read_bundle

        bundle = read_bundle(path)
        check_kinds(bundle, only or [])
        if not yes and not can_ask():
            raise KVRuntimeError(
                "reproduce runs the bundle's recorded commands (`kvcompile info` shows them): pass --yes to run them "
                "without a terminal to ask"
            )

        def confirm() -> bool:
            return yes or typer.confirm("Run these commands?", default=False)

        named = {"model": model, "corpus": corpus}
        verdicts = rerun(bundle, only or [], work, typer.echo, compile_commands(), named, confirm)
        if verdicts is None:
            typer.echo("nothing run")
            return
        for file, verdict in verdicts:
            typer.echo(printable(f"{file}: {verdict}"))
    if any(verdict.startswith("differs") for _, verdict in verdicts):
        raise typer.Exit(1)


@app.command(name="export-kvzap")
def export_kvzap(
    path: Annotated[Path, typer.Argument(help="A distilled_scorer artifact distilled with --student hidden.")],
    out: Annotated[Path, typer.Option(help="The checkpoint folder to write (config.json, model.safetensors).")],
) -> None:
    """Write a distilled scorer as a KVzap checkpoint that kvpress's KVzapModel.from_pretrained loads."""
    with clear_errors():
        from kvruntime.artifact_header import read_header

        kind = read_header(path).get("kind")  # a missing file or one that is not an artifact is refused here
        if kind != "distilled_scorer":
            raise KVRuntimeError(f"{path} is a {kind} artifact: export-kvzap takes a distilled_scorer")
        from kvcompile.recipes.distilled.kvzap_checkpoint import write_kvzap_checkpoint
        from kvruntime import read_artifact

        write_kvzap_checkpoint(read_artifact(path), out)
        typer.echo(f"wrote {out} (kvpress: KVzapModel.from_pretrained({str(out)!r}))")


if __name__ == "__main__":
    main()
