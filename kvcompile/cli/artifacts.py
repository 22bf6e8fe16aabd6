"""The commands that handle artifacts rather than compile them: `merge` (partial statistics), `info`, `bundle`,
`reproduce` and `export-kvzap` (registered on the command line's `app` when `kvcompile.cli` loads this module)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvcompile.cli.commands import COMPILE_COMMANDS, app, clear_errors
from kvcompile.recipe import claim_output
from kvruntime import KVRuntimeError
from kvruntime.errors import printable


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
        from kvruntime.artifacts.artifact_header import header_params, read_header

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
        from kvruntime.artifacts.bundle import locate, read_bundle

        folder = locate(path)  # a hub repo id is looked up once
        if folder.is_dir():
            from kvcompile.bundle import describe_bundle

            for line in describe_bundle(read_bundle(folder)):
                typer.echo(line)
            return
        from kvruntime.artifacts.artifact_header import read_header

        read_header(path)  # a missing file or one that is not an artifact is refused before torch loads
        from kvcompile.recipe import read_run_record
        from kvruntime import read_artifact
        from kvruntime.artifacts.artifact import check_tensors

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
        Path | None,
        typer.Option(
            help="A kvcompile eval --out folder: its measured table, source, command and plot go into the manifest "
            "and the model card."
        ),
    ] = None,
) -> None:
    """Write a bundle: the artifacts of one model, a manifest (sha256, command, calibration data, library versions
    of each) and a model card (README.md with hub metadata), loadable by its folder or as a hub repo."""
    with clear_errors() as resources:
        from kvcompile.bundle import bundle_sources, check_base_model, check_bundle_output, write_bundle
        from kvcompile.evaluation.published import eval_results

        files = bundle_sources(sources)
        check_bundle_output(out, sources)
        check_base_model(base_model)
        measured = None if results is None else (eval_results(results), results)
        claim_output(resources, out, folder=True)
        manifest = write_bundle(files, out, base_model, measured)
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
    default model or a cached hub model, and what --model and --corpus name. Exit code 1 when one differs or when
    none could be reproduced."""
    with clear_errors():
        from kvcompile.bundle import check_kinds
        from kvcompile.bundle import reproduce as rerun
        from kvruntime.artifacts.bundle import read_bundle

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
    if any(verdict.startswith("differs") for _, verdict in verdicts) or not any(
        verdict.startswith("reproduced") for _, verdict in verdicts
    ):
        raise typer.Exit(1)


@app.command(name="export-kvzap")
def export_kvzap(
    path: Annotated[Path, typer.Argument(help="A distilled_scorer artifact distilled with --student hidden.")],
    out: Annotated[Path, typer.Option(help="The checkpoint folder to write (config.json, model.safetensors).")],
) -> None:
    """Write a distilled scorer as a KVzap checkpoint that kvpress's KVzapModel.from_pretrained loads."""
    with clear_errors():
        from kvruntime.artifacts.artifact_header import read_header

        kind = read_header(path).get("kind")  # a missing file or one that is not an artifact is refused here
        if kind != "distilled_scorer":
            raise KVRuntimeError(f"{path} is a {kind} artifact: export-kvzap takes a distilled_scorer")
        from kvcompile.recipes.distilled.kvzap_checkpoint import write_kvzap_checkpoint
        from kvruntime import read_artifact

        write_kvzap_checkpoint(read_artifact(path), out)
        typer.echo(f"wrote {out} (kvpress: KVzapModel.from_pretrained({str(out)!r}))")
