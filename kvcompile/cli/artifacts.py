"""The commands that handle artifacts rather than compile them: `merge` (partial statistics), `info`, `bundle`,
`reproduce` and `export-kvzap` (registered on the command line's `app` when `kvcompile.cli` loads this module)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import typer

from kvcompile.cli.commands import COMPILE_COMMANDS, app, settings_command
from kvcompile.recipe import claim_output
from kvcompile.settings import option
from kvruntime import KVRuntimeError
from kvruntime.errors import first_line, printable


@dataclasses.dataclass(frozen=True)
class MergeOptions:
    partials: list[Path] = option(
        dataclasses.MISSING, "Partial statistics written by `--shard i/n` jobs.", argument=True
    )
    out: Path = option(
        dataclasses.MISSING, "Output: the finished artifact, or partial statistics if shards are missing."
    )


@settings_command(MergeOptions)
def merge(options: MergeOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Add up the partial statistics of separate jobs (heads, layer-errors, stats) into the artifact one run would
    write."""
    import time

    from kvcompile.calibration.shards import PARTIAL_KIND
    from kvcompile.recipe import claim_artifact
    from kvruntime.artifacts.artifact_header import header_params, read_header

    partials, out = options.partials, options.out
    started = time.perf_counter()
    if out.resolve() in {path.resolve() for path in partials}:
        raise KVRuntimeError(f"--out {out} is one of the partials being merged: give another file")
    statistics_of = set()
    for path in partials:
        if read_header(path).get("kind") != PARTIAL_KIND:
            raise KVRuntimeError(f"{path} is not partial statistics (written by a `--shard i/n` job)")
        params = header_params(path)
        problem = partial_params_problem(params)
        if problem:
            raise KVRuntimeError(f"{path}: not partial statistics a `--shard i/n` job writes ({problem})")
        statistics_of.add(params["statistics_of"])
    claim_artifact(resources, out, {PARTIAL_KIND, *statistics_of})

    from kvcompile.calibration.distributed import Shard
    from kvcompile.calibration.partial_statistics import DONE, merge_partials
    from kvcompile.recipe import read_run_record, write_result
    from kvcompile.recipes import RECIPES
    from kvruntime import load_artifact

    loaded = [load_artifact(path, kind=PARTIAL_KIND) for path in partials]
    for partial in loaded:
        if DONE not in partial.tensors or tuple(partial.tensors[DONE].shape) != (partial.params["items"],):
            raise KVRuntimeError(f"{partial.path}: not partial statistics a `--shard i/n` job writes (no {DONE} count)")
    shardable = {kind: recipe_type() for kind, recipe_type in RECIPES.items() if recipe_type.shardable}
    try:
        artifact = merge_partials(loaded, {kind: shardable[kind].finish for kind in shardable})
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        # Each recipe's settings and sums are its own: crafted ones that lack what its finisher reads end here.
        raise KVRuntimeError(
            f"{partials[0]}: its partial statistics cannot be finished ({first_line(exc)}): not what a `--shard i/n` "
            "job writes"
        ) from None
    merged_from = {
        "merged_from": [str(path) for path in partials],
        "shard_compile_seconds": [read_run_record(path).get("compile_seconds") for path in partials],
    }
    write_result(shardable.get(artifact.kind), artifact, out, started, Shard(), typer.echo, merged_from)


def partial_params_problem(params: dict) -> str | None:
    """What is wrong with a partial statistics artifact's params (`partial_statistics.partial_artifact` writes them),
    or None: they may be anyone's, and merge reads each of them."""
    kind, items, shards = params.get("statistics_of"), params.get("items"), params.get("shards")
    if not isinstance(kind, str) or not kind.isprintable():
        return "its statistics_of is not an artifact kind"
    if not isinstance(params.get("settings"), dict):
        return "its settings are not an object"
    if type(items) is not int or items < 1:
        return "its items are not a count"
    if not isinstance(shards, list) or not all(isinstance(shard, str) and shard.isprintable() for shard in shards):
        return "its shards are not a list of i/n"
    return None


@dataclasses.dataclass(frozen=True)
class InfoOptions:
    path: Path = option(
        dataclasses.MISSING, "Artifact file (.safetensors), or a bundle (its folder or hub repo id).", argument=True
    )


@settings_command(InfoOptions)
def info(options: InfoOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Print an artifact's kind, model, tensors and metadata, or a bundle's artifacts; refuse a file that is not a
    valid artifact and a bundle whose files do not match its manifest."""
    from kvruntime.artifacts.bundle import locate, read_bundle

    path = options.path
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
    lines = [f"{path}: {artifact.kind} artifact", f"model: {artifact.model.describe()}", "tensors:"]
    for name, tensor in sorted(artifact.tensors.items()):
        lines.append(f"  {name}: {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}")
    lines.append("provenance: " + json.dumps(artifact.provenance, indent=2, sort_keys=True))
    lines.append("params: " + json.dumps(artifact.params, indent=2, sort_keys=True))
    run = read_run_record(path)
    if run:
        lines.append("run: " + json.dumps(run, indent=2, sort_keys=True))
    for line in "\n".join(lines).split("\n"):
        typer.echo(printable(line))  # the file's text (its model's architecture, a tensor's name) may be anyone's


@dataclasses.dataclass(frozen=True)
class BundleOptions:
    sources: list[Path] = option(
        dataclasses.MISSING, "Artifact files, or folders of artifacts (every artifact in them).", argument=True
    )
    out: Path = option(dataclasses.MISSING, "The bundle folder to write (replaced if it is a bundle).")
    base_model: str | None = option(
        None, "The model's hub id for the card (default: from the artifacts' --model, if a hub id)."
    )
    results: Path | None = option(
        None,
        "A kvcompile eval --out folder: its measured table, source, command and plot go into the manifest and the "
        "model card.",
    )


@settings_command(BundleOptions)
def bundle(options: BundleOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Write a bundle: the artifacts of one model, a manifest (sha256, command, calibration data, library versions
    of each) and a model card (README.md with hub metadata), loadable by its folder or as a hub repo."""
    from kvcompile.bundle import (
        bundle_sources,
        check_base_model,
        check_bundle_output,
        check_results_files,
        write_bundle,
    )
    from kvcompile.evaluation.published import eval_results

    sources, out, base_model, results = options.sources, options.out, options.base_model, options.results
    files = bundle_sources(sources)
    check_bundle_output(out, sources)
    check_base_model(base_model)
    if results is not None:
        check_results_files(results)  # what eval_results reads as text: plain files, bounded, numbers of few digits
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


@dataclasses.dataclass(frozen=True)
class ReproduceOptions:
    path: Path = option(dataclasses.MISSING, "A bundle (its folder or hub repo id).", argument=True)
    only: list[str] | None = option(None, "Reproduce only the artifacts of this kind (repeatable).")
    work: Path | None = option(None, "Where the scratch folder goes (default: the system's).")
    model: str | None = option(None, "The model to use where a recorded command names a local model folder.")
    corpus: str | None = option(None, "The corpus to use where a recorded command names a corpus file or folder.")
    yes: bool = option(False, "Run the commands shown without asking.", flag="--yes")


@settings_command(ReproduceOptions)
def reproduce(options: ReproduceOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Rerun the compile command recorded for each of a bundle's artifacts and compare the bytes with the bundle's.
    It shows the commands and asks first; each reads only the bundle's files, the data shipped with kvcompile, the
    default model or a cached hub model, and what --model and --corpus name. Exit code 1 when one differs or when
    none could be reproduced."""
    from kvcompile.bundle import check_kinds
    from kvcompile.bundle import reproduce as rerun
    from kvruntime.artifacts.bundle import read_bundle

    path, only, work, yes = options.path, options.only, options.work, options.yes
    bundle = read_bundle(path)
    check_kinds(bundle, only or [])
    if not yes and not can_ask():
        raise KVRuntimeError(
            "reproduce runs the bundle's recorded commands (`kvcompile info` shows them): pass --yes to run them "
            "without a terminal to ask"
        )

    def confirm() -> bool:
        return yes or typer.confirm("Run these commands?", default=False)

    named = {"model": options.model, "corpus": options.corpus}
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


@dataclasses.dataclass(frozen=True)
class ExportKvzapOptions:
    path: Path = option(
        dataclasses.MISSING, "A distilled_scorer artifact distilled with --student hidden.", argument=True
    )
    out: Path = option(dataclasses.MISSING, "The checkpoint folder to write (config.json, model.safetensors).")


@settings_command(ExportKvzapOptions, name="export-kvzap")
def export_kvzap(options: ExportKvzapOptions, ctx: typer.Context, resources: contextlib.ExitStack) -> None:
    """Write a distilled scorer as a KVzap checkpoint that kvpress's KVzapModel.from_pretrained loads."""
    from kvruntime.artifacts.artifact_header import read_header

    path, out = options.path, options.out
    kind = read_header(path).get("kind")  # a missing file or one that is not an artifact is refused here
    if kind != "distilled_scorer":
        raise KVRuntimeError(f"{path} is a {kind} artifact: export-kvzap takes a distilled_scorer")
    from kvcompile.recipes.distilled.kvzap_checkpoint import write_kvzap_checkpoint
    from kvruntime import read_artifact

    write_kvzap_checkpoint(read_artifact(path), out)
    typer.echo(f"wrote {out} (kvpress: KVzapModel.from_pretrained({str(out)!r}))")
