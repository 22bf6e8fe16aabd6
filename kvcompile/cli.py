"""The `kvcompile` command line."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
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
def clear_errors() -> Iterator[None]:
    """Bad input ends the command with one line naming the problem and a non-zero exit, no traceback."""
    try:
        yield
    except KVRuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _read_prompt(path: Path) -> str:
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
    method: Annotated[str, typer.Option(help="Compression method: snapkv, kvcompress.")] = "kvcompress",
    ratio: Annotated[Optional[float], typer.Option(help="Fraction of cache entries removed, in [0, 1).")] = None,
    budget: Annotated[Optional[int], typer.Option(help="Tokens kept per layer (instead of --ratio).")] = None,
    question: Annotated[
        Optional[list[str]],
        typer.Option(help="Question mode: compress the prompt without the question, then answer each --question."),
    ] = None,
    memory: Annotated[str, typer.Option(help="padded (default) or masked: how per-head counts are stored.")] = "padded",
    artifact: Annotated[Optional[list[Path]], typer.Option(help="Compiled artifact(s), checked against the model.")] = None,
    force: Annotated[bool, typer.Option(help="Apply artifacts of another checkpoint of the same shape.")] = False,
    model: ModelOption = "default",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 32,
) -> None:
    """Generate from a prompt file with a compressed KV cache, then print the compression report."""
    with clear_errors():
        import transformers  # imported here, like kvruntime, so that `--help` stays fast

        import kvruntime

        if ratio is None and budget is None:
            ratio = 0.5
        prompt = _read_prompt(prompt_file)
        compression_method = kvruntime.get_method(method)
        kvruntime.CompressionSession.check_request(compression_method, ratio, budget, memory)
        transformers.utils.logging.disable_progress_bar()
        loaded, tokenizer = kvruntime.load_model(model)
        greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
        context_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with kvruntime.compress(
            loaded, compression_method, ratio=ratio, budget=budget, memory=memory, artifacts=artifact or (), force=force
        ) as session:
            if question:
                context = session.prefill(context_ids)
                for text in question:
                    question_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
                    answer = context.generate(question_ids, **greedy)[0, question_ids.shape[1] :]
                    typer.echo(f"Q: {text.strip()}\nA: {tokenizer.decode(answer, skip_special_tokens=True)}")
            else:
                output = loaded.generate(context_ids, **greedy)
                typer.echo(tokenizer.decode(output[0, context_ids.shape[1] :], skip_special_tokens=True))
        typer.echo(str(session.report))


@app.command()
def info(path: Annotated[Path, typer.Argument(help="Artifact file (.safetensors).")]) -> None:
    """Print an artifact's kind, model, tensors and metadata; refuse a file that is not a valid artifact."""
    with clear_errors():
        from kvruntime.artifact import read_artifact

        artifact = read_artifact(path)
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
