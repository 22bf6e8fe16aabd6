"""Writing and reproducing artifact bundles (`kvcompile bundle`, `kvcompile reproduce`); the format and its checks
are the runtime's (`kvruntime.artifacts.bundle`), which reads a bundle without the compile stage.

A bundle is one folder per compiled model: the artifacts (with their pictures and run records), `manifest.json`
(per artifact: kind, sha256 of its bytes, provenance with the command that reruns it, the calibration data and its
hash, the library versions; the model's fingerprint) and `README.md`, a model card with the metadata a model hub
reads (base model, library, tags) and the measured results the artifacts carry.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcompile import __version__
from kvcompile.evaluation.published import PICTURE, PICTURE_MAX_BYTES, results_lines
from kvcompile.markdown import markdown_code, markdown_text
from kvcompile.recipe import OUTPUT_OPTIONS, PARTIAL_KIND, picture_path, read_run_record, run_record_path
from kvruntime import ArtifactError, KVRuntimeError
from kvruntime.artifacts.artifact_header import (
    ARTIFACT_SUFFIX,
    load_json,
    open_plain_file,
    read_header,
    read_plain_file,
)
from kvruntime.artifacts.bundle import (
    BUNDLE_FORMAT,
    BUNDLE_FORMAT_VERSION,
    CARD_NAME,
    MANIFEST_NAME,
    Bundle,
    file_sha256,
    is_hub_id,
    is_plain_name,
    manifest_problem,
    read_bundle,
)
from kvruntime.errors import printable, short_repr
from kvruntime.models.default_model import DEFAULT_MODEL, SHIPPED_MODELS

CARD_TAGS = ("kvcompile", "kv-cache-compression", "kv-cache", "kvpress", "long-context")
# What `kvcompile reproduce` needs in an artifact's provenance: written by kvcompile since commands were recorded
# in full (every setting spelled out) and the library versions with them.
REPRODUCIBLE_FIELDS = ("command", "libraries")
# Written last into every bundle `kvcompile bundle` writes: the files it wrote and their sha256. Only a folder holding
# exactly those files, unchanged, is replaced by a later `kvcompile bundle --out` (a manifest.json alone proves
# nothing: a user's folder or a git clone of a bundle may hold one).
MARKER_NAME = ".kvcompile-bundle.json"
MARKER_MAX_BYTES = 1 << 20
# What `--results` reads of an eval folder as text (`evaluation.published.eval_results`), each at most this large: a
# run's records take kilobytes per prompt, so a larger file (or /dev/zero behind a link) is refused unread.
RESULTS_TEXT_FILES = ("run.json", "runs.jsonl", "results.md")
RESULTS_MAX_BYTES = 64 << 20


def bundle_sources(sources: Sequence[Path]) -> list[Path]:
    """The artifact files `sources` name: files as given, every kvcompile artifact in a folder (not partial
    statistics or checkpoints). Refuses a source that is missing or names no artifact."""
    files: list[Path] = []
    for source in sources:
        if source.is_dir():
            found = [p for p in sorted(source.glob(f"*{ARTIFACT_SUFFIX}")) if _is_artifact(p)]
            if not found:
                raise KVRuntimeError(f"{source}: no kvcompile artifact in this folder")
            files += found
        else:
            read_header(source)  # refuses a missing file or one that is not an artifact
            files.append(source)
    names = [path.name for path in files]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise KVRuntimeError(f"two artifacts named {twice[0]}: a bundle holds one file per name")
    return files


def _is_artifact(path: Path) -> bool:
    try:
        return read_header(path).get("kind") not in (PARTIAL_KIND, None)
    except KVRuntimeError:
        return False  # a checkpoint or a foreign safetensors file beside the artifacts


def write_bundle(
    files: Sequence[Path],
    out: Path,
    base_model: str | None = None,
    measured: tuple[dict[str, Any], Path] | None = None,
) -> dict[str, Any]:
    """Check the artifacts (readable, of one model), then write the bundle folder `out` in a staging folder, read
    it back as a bundle there, and only then move it into place whole: a refusal leaves `out` as it was.
    `measured`: an eval run's results (`evaluation.published.eval_results`) and its folder, carried in the manifest
    and the card with its plot. Returns the manifest."""
    from kvruntime import read_artifact
    from kvruntime.artifacts.artifact import check_tensors
    from kvruntime.files import replace_folder

    artifacts = [read_artifact(path) for path in files]
    for artifact in artifacts:
        check_tensors(artifact)
    model = artifacts[0].model
    for artifact in artifacts[1:]:
        if artifact.model != model:
            raise KVRuntimeError(
                f"{artifact.path} was compiled for another model than {artifacts[0].path}: a bundle holds one model's"
            )
    entries = []
    for artifact in artifacts:
        source = Path(artifact.path)
        check_plain_or_absent(run_record_path(source))  # read_run_record would follow a link, or wait on a FIFO
        entry = {
            "file": source.name,
            "kind": artifact.kind,
            "sha256": file_sha256(source),
            "bytes": source.stat().st_size,
            "provenance": artifact.provenance,
            "params": artifact.params,
            "run": published(read_run_record(source)),
        }
        if os.path.lexists(picture_path(source)):  # copied only as a plain file (`copy_plain_file`), never a link
            entry["picture"] = picture_path(source).name
        entries.append(entry)
    manifest = {
        "format": BUNDLE_FORMAT,
        "format_version": BUNDLE_FORMAT_VERSION,
        "model": model.to_dict(),
        "base_model": base_model or guess_base_model(artifacts),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "bundled_by": f"kvcompile {__version__}",
        "artifacts": entries,
        **({"results": measured[0]} if measured else {}),
    }
    problem = manifest_problem(manifest)  # the runtime's reading of a manifest, before anything is written
    if problem:
        raise KVRuntimeError(f"the bundle's manifest would be refused ({problem}): nothing written")
    card = model_card(manifest, artifacts)

    def write(folder: Path) -> None:
        for source, entry in zip(files, entries):
            for companion in (source, picture_path(source)):
                if os.path.lexists(companion):
                    copy_plain_file(companion, folder / companion.name)
            if entry["run"]:
                text = json.dumps(entry["run"], indent=2, sort_keys=True) + "\n"
                (folder / run_record_path(source).name).write_text(text, encoding="utf-8")
            if file_sha256(folder / source.name) != entry["sha256"]:  # replaced by a compile since it was checked
                raise KVRuntimeError(f"{source} changed while it was being bundled: run kvcompile bundle again")
        if measured and "picture" in measured[0]:
            copy_plain_file(measured[1] / PICTURE, folder / measured[0]["picture"], PICTURE_MAX_BYTES)
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (folder / CARD_NAME).write_text(card, encoding="utf-8")
        written = {path.name: file_sha256(path) for path in sorted(folder.iterdir())}
        (folder / MARKER_NAME).write_text(json.dumps({"files": written}, indent=1) + "\n", encoding="utf-8")
        read_bundle(folder)  # what was written reads back as a bundle, before it replaces anything

    replace_folder(out, write)
    return manifest


def check_plain_or_absent(path: Path) -> None:
    """Refuse a file that is there but not a plain file (`open_plain_file`: a link, a FIFO or a device)."""
    if os.path.lexists(path):
        open_plain_file(path).close()


def copy_plain_file(source: Path, target: Path, limit: int | None = None) -> None:
    """Copy a plain file (`open_plain_file`: never through a link, never a FIFO or a device), of at most `limit`
    bytes when one is given, into a new file `target`."""
    with open_plain_file(source) as handle, open(target, "xb") as copy:
        if limit is None:
            shutil.copyfileobj(handle, copy)
        elif copy.write(handle.read(limit + 1)) > limit:
            raise KVRuntimeError(f"{source} holds more than {limit} bytes: more than a bundle carries")


def check_results_files(folder: Path) -> None:
    """Refuse, in one line, an eval folder (`--results`) whose files `eval_results` reads as text are not plain
    files of at most RESULTS_MAX_BYTES, or whose records hold what `load_json` refuses (a number of more digits than
    any record's, a key given twice). The folder may be anyone's: its other problems `eval_results` names."""
    for name in RESULTS_TEXT_FILES:
        path = folder / name
        if not os.path.lexists(path):
            continue  # eval_results names a missing run.json or runs.jsonl
        try:
            text = read_plain_file(path, RESULTS_MAX_BYTES).decode("utf-8", errors="replace")
        except ArtifactError as exc:
            raise KVRuntimeError(f"--results {exc}") from None
        if name == "results.md":
            continue  # text, not JSON
        for number, line in enumerate(text.split("\n") if name == "runs.jsonl" else [text], 1):
            try:
                load_json(line)
            except (json.JSONDecodeError, RecursionError):
                continue  # not JSON: eval_results says where
            except ValueError as exc:
                where = f" line {number}" if name == "runs.jsonl" else ""
                raise KVRuntimeError(f"--results {path}{where} holds {exc}: not a kvcompile eval run's") from None


def published(run: dict[str, Any]) -> dict[str, Any]:
    """A run record as a bundle publishes it: each absolute path in it (an --out, merged shards) by its file name
    alone, so that the compiling machine's folders stay private."""

    def name_only(word: str) -> str:
        option, equals, value = word.partition("=")
        if equals and option.startswith("--"):
            return f"{option}={name_only(value)}"
        return Path(word).name if os.path.isabs(os.path.expanduser(word)) else word

    def clean(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: clean(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, str) and key == "command_line":
            return shlex.join(name_only(word) for word in shlex.split(value))
        return name_only(value) if isinstance(value, str) else value

    return clean(run)


def check_base_model(base_model: str | None) -> None:
    """Refuse a --base-model that is not a hub repo id (`org/name`): the card's metadata names the model by it."""
    if base_model is not None and not is_hub_id(base_model):
        raise KVRuntimeError(f"--base-model {short_repr(base_model)}: give the model's hub repo id (org/name)")


def guess_base_model(artifacts: Sequence[Any]) -> str | None:
    """The hub id of the model the artifacts' commands compiled (`--model`): a shipped model's, or a hub id given
    as it is; None for a local folder."""
    for artifact in artifacts:
        words = shlex.split(str(artifact.provenance.get("command", "")))
        model = words[words.index("--model") + 1] if "--model" in words[:-1] else DEFAULT_MODEL
        if model in SHIPPED_MODELS:
            return SHIPPED_MODELS[model].hub_id
        if is_hub_id(model) and not Path(model).exists():
            return model
    return None


def model_card(manifest: dict[str, Any], artifacts: Sequence[Any]) -> str:
    """The bundle's README.md: hub metadata (YAML front matter, written by a YAML emitter), what each artifact is and
    how it was made, how to apply the bundle, and the measured results it carries (a tuned_defaults artifact's
    validation, an eval run's table). Every value taken from an artifact or a record is escaped for Markdown and
    HTML (`kvcompile.markdown`): they may come from anyone."""
    import yaml

    base = manifest["base_model"]
    metadata = {**({"base_model": base} if base else {}), "library_name": "kvcompile", "tags": list(CARD_TAGS)}
    front = ["---", yaml.safe_dump(metadata, sort_keys=False, allow_unicode=False).rstrip("\n"), "---", ""]
    model = manifest["model"]
    title = markdown_text(base.split("/")[-1] if base else model["architecture"])
    lines = [
        f"# kvcompile artifacts for {title}",
        "",
        "KV-cache compression statistics compiled offline by kvcompile for "
        f"{markdown_text(base or 'a local model')} ({markdown_text(model['architecture'])}, {model['num_layers']} "
        f"layers, {model['num_query_heads']} query heads, {model['num_kv_heads']} KV heads, weights hash "
        f"{markdown_code(model['weights_hash'])}). The runtime (`pip install kvruntime`) applies them inside "
        "`model.generate`; it refuses them for any other model.",
        "",
        "| file | kind | calibration data (sha256) | command |",
        "| --- | --- | --- | --- |",
    ]
    for entry in manifest["artifacts"]:
        provenance = entry["provenance"]
        corpus = markdown_text(provenance.get("calibration_data", "-"))
        digest = markdown_text(str(provenance.get("calibration_sha256", ""))[:12])
        command = markdown_code(provenance.get("command", "-"))
        lines.append(
            f"| {markdown_code(entry['file'])} | {markdown_text(entry['kind'])} | {corpus} ({digest}) | {command} |"
        )
    lines += [
        "",
        "`manifest.json` holds each file's sha256, its full provenance (seed, library versions) and the run that made",
        "it (date, wall time, machine). `kvcompile reproduce <this folder>` reruns the recorded commands and compares",
        "the bytes.",
        "",
        "## Use",
        "",
        *usage(base, {entry["kind"] for entry in manifest["artifacts"]}),
        "",
        "## Measured results",
        "",
    ]
    tuned = [a for a in artifacts if a.kind == "tuned_defaults"]
    if tuned:
        lines += tuned_validation_table(tuned[0])
    if "results" in manifest:
        lines += results_lines(manifest["results"])
    if not tuned and "results" not in manifest:
        lines += ["None carried: this bundle holds no tuned_defaults artifact and was given no eval results.", ""]
    return "\n".join(front + lines)


def usage(base: str | None, kinds: set[str]) -> list[str]:
    """How to apply the bundle: kvruntime (the tuned default, else a method the bundle serves), the command line,
    and kvpress where the bundle holds a scorer it has a press for."""
    from kvruntime.registry import METHODS

    served = [name for name, spec in METHODS.items() if spec.needs in kinds]
    method = "" if "tuned_defaults" in kinds or not served else f'"{served[0]}", ratio=0.5, '
    lines = [
        "```python",
        "import kvruntime",
        "",
        f'model, tokenizer = kvruntime.load_model("{base or "path/to/model"}")',
        f'with kvruntime.compress(model, {method}artifacts=["<this repo id or folder>"]):',
        '    output = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=32)',
        "```",
        "",
        "Command line: `kvcompile generate --artifact <this repo id or folder> "
        + (f"--method {served[0]} --ratio 0.5 " if method else "")
        + "--prompt-file PROMPT`.",
    ]
    presses = {"distilled_scorer": "DistilledPress", "srh_heads": "SRHPress"}
    for kind, press in presses.items():
        if kind in kinds:
            lines += [
                f'kvpress: `{press}.from_artifact("<this repo id or folder>", compression_ratio=0.5)` '
                "(`kvruntime.integrations.kvpress`).",
            ]
    return lines


def tuned_validation_table(artifact: Any) -> list[str]:
    """A tuned_defaults artifact's validation accuracy per method and ratio, as markdown (its text escaped)."""
    from kvcompile.recipes.tuned_defaults.tuning import UNMEASURED  # a ratio not tried (past the tolerance)

    params, tensors = artifact.params, artifact.tensors
    ratios = [f"{r:g}" for r in tensors["ratios"].tolist()]
    prompts = markdown_text(artifact.provenance.get("validation_prompts", "?"))
    tasks = markdown_text(", ".join(map(str, params.get("tasks", []))))
    lines = [
        f"Validation accuracy (`kvcompile tune`: {prompts} prompts of tasks {tasks}, "
        f"{'question-aware' if params.get('question_aware') else 'question-agnostic'}; calibration data "
        f"{markdown_text(artifact.provenance.get('calibration_data'))}); full cache "
        f"{tensors['full_accuracy'].item():.3f}:",
        "",
        "| method | " + " | ".join(ratios) + " |",
        "| --- |" + " --- |" * len(ratios),
    ]
    for method, row in zip(params.get("methods", []), tensors["accuracy"].tolist()):
        cells = [f"{value:.3f}" if value != UNMEASURED else "-" for value in row]
        lines.append(f"| {markdown_text(method)} | " + " | ".join(cells) + " |")
    recommended = params.get("recommended") or {}
    if recommended:
        lines += ["", "Recommended (the runtime's default with this bundle): "
                  f"{markdown_text(recommended.get('method'))} at ratio {markdown_text(recommended.get('ratio'))}."]  # fmt: skip
    return lines + [""]


@dataclasses.dataclass(frozen=True)
class CompileCommand:
    """What `reproduce` knows of a compile command: its option strings (each to its parameter's name) and the
    parameters that read a file or folder."""

    options: Mapping[str, str]
    flags: frozenset[str]  # the option strings that take no value
    paths: frozenset[str]


def check_kinds(bundle: Bundle, kinds: Sequence[str]) -> None:
    """Refuse an --only kind the bundle does not hold."""
    unknown = sorted(set(kinds) - {entry["kind"] for entry in bundle.entries})
    if unknown:
        raise KVRuntimeError(f"--only {printable(unknown[0])}: the bundle holds {', '.join(bundle.kinds())}")


class NotReproducible(Exception):
    """Why an artifact's recorded command is not rerun: its verdict."""


def reproduce(
    bundle: Bundle,
    kinds: Sequence[str],
    work: Path | None,
    echo: Callable[[str], None],
    commands: Mapping[str, CompileCommand],
    named: Mapping[str, str | None],
    confirm: Callable[[], bool],
) -> list[tuple[str, str]] | None:
    """Rerun each chosen artifact's recorded command into a scratch folder (once per command: a companion such as
    CompilerKV's experience is written beside its main artifact) and compare the bytes with the bundle's: (file,
    verdict) per artifact, the verdict 'reproduced ...', 'differs: ...' or 'not reproducible: ...'; None when the
    user does not confirm the commands shown.

    A bundle may come from anyone: only the compile `commands` run, each input a file of the bundle, of the data
    shipped with kvcompile, a shipped corpus, the default model or a hub id, or else what the user `named` (model,
    corpus); they run from the scratch folder, with the current folder off Python's path (`-P`)."""
    from kvcompile.calibration.provenance import library_versions
    from kvcompile.recipes import RECIPES

    chosen = [entry for entry in bundle.entries if not kinds or entry["kind"] in kinds]
    verdicts: dict[str, str] = {}
    runs: dict[str, list[dict[str, Any]]] = {}  # command -> its entries, the recipe's own artifact first
    arguments: dict[str, list[str]] = {}
    for entry in chosen:
        provenance = entry.get("provenance") or {}
        if any(field not in provenance for field in REPRODUCIBLE_FIELDS):
            verdicts[entry["file"]] = "not reproducible: compiled before kvcompile recorded its full command"
            continue
        try:
            arguments[provenance["command"]] = rerun_arguments(provenance["command"], bundle, commands, named)
        except NotReproducible as exc:
            verdicts[entry["file"]] = f"not reproducible: {exc}"
            continue
        runs.setdefault(provenance["command"], []).append(entry)
    for command, entries in runs.items():
        entries.sort(key=lambda entry: entry["kind"] not in RECIPES)
        echo(f"{entries[0]['file']}: kvcompile {printable(shlex.join(arguments[command]))} --out <scratch>")
    if runs and not confirm():
        return None
    installed = library_versions()
    main = "from kvcompile.cli import main; main()"
    with tempfile.TemporaryDirectory(dir=work, prefix="kvcompile-reproduce-") as scratch:
        for command, entries in runs.items():
            out = Path(scratch) / entries[0]["file"]
            argv = [sys.executable, "-P", "-c", main, *arguments[command], "--out", str(out)]
            ran = subprocess.run(argv, cwd=scratch)
            for entry in entries:
                made = Path(scratch) / entry["file"]
                verdicts[entry["file"]] = _verdict(entry, made, ran.returncode, installed)
    return [(entry["file"], verdicts[entry["file"]]) for entry in chosen]


def rerun_arguments(
    command: str, bundle: Bundle, commands: Mapping[str, CompileCommand], named: Mapping[str, str | None]
) -> list[str]:
    """The arguments (after `kvcompile`) that rerun a recorded command, each input resolved to where it may be
    read from (`reproduce`); NotReproducible says why not."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise NotReproducible(f"its recorded command is not a command line ({exc})") from None
    if len(words) < 2 or words[0] != "kvcompile" or words[1] not in commands:
        raise NotReproducible(
            f"its recorded command is not one of kvcompile's compile commands ({', '.join(commands)})"
        )
    known = commands[words[1]]
    arguments = words[1:]
    index = 1
    while index < len(arguments):
        option, equals, value = arguments[index].partition("=")
        name = known.options.get(option)
        if name is None:
            raise NotReproducible(f"its recorded command has a word {words[1]} does not take ({option})")
        if name in OUTPUT_OPTIONS:
            raise NotReproducible(f"its recorded command names where to write ({option})")
        if option in known.flags:
            index += 1
            continue
        if not equals:
            if index + 1 == len(arguments):
                raise NotReproducible(f"its recorded command gives {option} no value")
            value = arguments[index + 1]
        resolved = _input(name, value, bundle, known, named)
        if resolved is None:
            hint = f": name it with --{name}" if name in named else ""
            raise NotReproducible(f"it reads {value}, which is neither in the bundle nor shipped with kvcompile{hint}")
        arguments[index : index + (1 if equals else 2)] = [f"{option}={resolved}"] if equals else [option, resolved]
        index += 1 if equals else 2
    return arguments


def _input(name: str, value: str, bundle: Bundle, known: CompileCommand, named: Mapping[str, str | None]) -> str | None:
    """What a recorded option's value becomes when rerun: as recorded when it reads nothing, a shipped corpus, the
    default model or a hub id; the bundle's or kvcompile's own file; else what the user named, or None. A value
    holding an absolute path or `..` anywhere (`--methods distilled:artifacts=/home/x`) is never taken as recorded."""
    from kvcompile.calibration.corpus import SHIPPED_CORPORA

    if _leads_outside(value):
        return named.get(name) if name in ("model", "corpus") else None
    if name == "model":
        return value if value in SHIPPED_MODELS or is_hub_id(value) else named.get("model")
    if name == "corpus":
        return value if value in SHIPPED_CORPORA else _inside(value, bundle) or named.get("corpus")
    return _inside(value, bundle) if name in known.paths else value


def _leads_outside(value: str) -> bool:
    """Whether a recorded value names an absolute path or `..` in any of its parts (a list's items, a method's
    options: split at `,`, `:` and `=`)."""
    parts = re.split(r"[,:=]", value)
    return any(os.path.isabs(os.path.expanduser(part)) or ".." in Path(part).parts for part in parts)


def _inside(value: str, bundle: Bundle) -> str | None:
    """Where a recorded input path is read from: the bundle's file of that name, or the data shipped with
    kvcompile (`calibration_data/...`); None for anything else (an absolute path, `..`, a file elsewhere)."""
    from kvcompile.shipped import shipped_folder

    path = Path(value)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return None
    if path.name in {entry["file"] for entry in bundle.entries}:
        return str(bundle.folder.resolve() / path.name)
    if path.parts[0] == "calibration_data" and len(path.parts) > 1:
        shipped = shipped_folder("calibration_data").joinpath(*path.parts[1:])
        return str(shipped) if shipped.exists() else None
    return None


def _verdict(entry: dict[str, Any], made: Path, returncode: int, installed: dict[str, str]) -> str:
    if returncode != 0 or not made.is_file():
        return f"differs: the command failed (exit code {returncode})"
    digest = file_sha256(made)
    if digest == entry["sha256"]:
        return f"reproduced (sha256 {digest[:12]}, the same bytes)"
    recorded = entry["provenance"]["libraries"]
    changed = sorted(name for name, version in recorded.items() if installed.get(name) != version)
    why = f"; installed versions differ: {', '.join(changed)}" if changed else ""
    return f"differs: sha256 {digest[:12]}, the bundle's {entry['sha256'][:12]}{why}"


def describe_bundle(bundle: Bundle) -> list[str]:
    """What `kvcompile info` prints for a bundle (its manifest's text escaped: it may come from anyone)."""
    from kvruntime.artifacts.fingerprint import ModelFingerprint

    base = bundle.manifest.get("base_model")
    lines = [
        f"{bundle.folder}: kvcompile bundle ({len(bundle.entries)} artifact files, each matching its manifest)",
        f"model: {ModelFingerprint.from_dict(bundle.model).describe()}" + (f" ({base})" if base else ""),
        f"created {bundle.manifest.get('created', '?')} by {bundle.manifest.get('bundled_by', '?')}",
        "artifacts:",
    ]
    for entry in bundle.entries:
        provenance, run = entry.get("provenance") or {}, entry.get("run") or {}
        took = f", {run['compile_seconds']} s" if "compile_seconds" in run else ""
        lines.append(
            f"  {entry['file']}: {entry['kind']}, calibration {provenance.get('calibration_data', '-')}{took}, "
            f"sha256 {entry['sha256'][:12]}"
        )
        lines.append(f"    made by: {provenance.get('command', '-')}")
    if "results" in bundle.manifest:
        shown = results_lines(bundle.manifest["results"], printable, printable)
        lines += ["measured results:", *(f"  {line}" for line in shown if line)]
    return [printable(line) for line in lines]


def check_bundle_output(out: Path, sources: Sequence[Path]) -> None:
    """Refuse an --out that would replace anything but a bundle this command wrote (unchanged since), that holds
    the current folder, that is a symbolic link, or that overlaps a source."""
    if out.is_symlink():
        raise KVRuntimeError(f"--out {out} is a symbolic link: give the folder itself")
    resolved = out.resolve()  # as the system resolves it: `x/..` through a linked x is not the lexical folder
    if resolved == Path.cwd() or resolved in Path.cwd().parents:
        raise KVRuntimeError(f"--out {out} holds the current folder: give a new folder for the bundle")
    if out.exists():
        if not out.is_dir():
            raise KVRuntimeError(f"--out {out} is a file: give a folder for the bundle")
        if any(out.iterdir()) and not is_written_bundle(out):
            raise KVRuntimeError(
                f"--out {out} holds files that `kvcompile bundle` did not write there (or that changed since): "
                "it replaces only its own bundles; give a new or empty folder"
            )
    real = out.resolve()
    for source in sources:
        inside = source.resolve()
        if real == inside or real in inside.parents or inside in real.parents:
            raise KVRuntimeError(f"--out {out} overlaps the source {source}: write the bundle to another folder")


def is_written_bundle(folder: Path) -> bool:
    """Whether `folder` holds exactly the files its marker says `kvcompile bundle` wrote, each a plain file with
    the bytes it wrote: nothing a user added or edited, no subfolder (a git clone's .git), no link."""
    marker = folder / MARKER_NAME
    try:
        written = load_json(read_plain_file(marker, MARKER_MAX_BYTES).decode("utf-8")).get("files")
    except (OSError, ValueError, RecursionError, AttributeError, ArtifactError):
        return False
    if not isinstance(written, dict) or not all(is_plain_name(name) for name in written):
        return False
    present = {path.name: path for path in folder.iterdir() if path.name != MARKER_NAME}
    if set(present) != set(written):
        return False
    return all(
        not path.is_symlink() and path.is_file() and file_sha256(path) == written[name]
        for name, path in present.items()
    )
