"""Writing and reproducing artifact bundles (`kvcompile bundle`, `kvcompile reproduce`); the format and its checks
are the runtime's (`kvruntime.bundle`), which reads a bundle without the compile stage.

A bundle is one folder per compiled model: the artifacts (with their pictures and run records), `manifest.json`
(per artifact: kind, sha256 of its bytes, provenance with the command that reruns it, the calibration data and its
hash, the library versions; the model's fingerprint) and `README.md`, a model card with the metadata a model hub
reads (base model, library, tags) and the measured results the artifacts carry.
"""

from __future__ import annotations

import datetime
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcompile import __version__
from kvcompile.recipe import PARTIAL_KIND, picture_path, read_run_record, run_record_path
from kvruntime import KVRuntimeError
from kvruntime.artifact_header import ARTIFACT_SUFFIX, read_header
from kvruntime.bundle import (
    BUNDLE_FORMAT,
    BUNDLE_FORMAT_VERSION,
    CARD_NAME,
    MANIFEST_NAME,
    Bundle,
    file_sha256,
    is_bundle,
    is_hub_id,
    read_bundle,
)
from kvruntime.default_model import DEFAULT_MODEL

DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what `--model default` is, for the card's base_model
CARD_TAGS = ("kvcompile", "kv-cache-compression", "kv-cache", "kvpress", "long-context")
# What `kvcompile reproduce` needs in an artifact's provenance: written by kvcompile since commands were recorded
# in full (every setting spelled out) and the library versions with them.
REPRODUCIBLE_FIELDS = ("command", "libraries")


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
    files: Sequence[Path], out: Path, base_model: str | None = None, results: str | None = None
) -> dict[str, Any]:
    """Check the artifacts (readable, of one model), then write the bundle folder `out` in a staging folder and
    move it into place whole. Returns the manifest."""
    from kvruntime import read_artifact
    from kvruntime.artifact import check_tensors
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
        entry = {
            "file": source.name,
            "kind": artifact.kind,
            "sha256": file_sha256(source),
            "bytes": source.stat().st_size,
            "provenance": artifact.provenance,
            "params": artifact.params,
            "run": read_run_record(source),
        }
        if picture_path(source).is_file():
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
    }
    card = model_card(manifest, artifacts, results)

    def write(folder: Path) -> None:
        for source, entry in zip(files, entries):
            for companion in (source, picture_path(source), run_record_path(source)):
                if companion.is_file():
                    shutil.copyfile(companion, folder / companion.name)
            if file_sha256(folder / source.name) != entry["sha256"]:  # replaced by a compile since it was checked
                raise KVRuntimeError(f"{source} changed while it was being bundled: run kvcompile bundle again")
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (folder / CARD_NAME).write_text(card, encoding="utf-8")

    replace_folder(out, write)
    read_bundle(out)  # what was written reads back as a bundle
    return manifest


def guess_base_model(artifacts: Sequence[Any]) -> str | None:
    """The hub id of the model the artifacts' commands compiled (`--model`): the default model's, or a hub id given
    as it is; None for a local folder."""
    for artifact in artifacts:
        words = shlex.split(str(artifact.provenance.get("command", "")))
        model = words[words.index("--model") + 1] if "--model" in words[:-1] else DEFAULT_MODEL
        if model == DEFAULT_MODEL:
            return DEFAULT_MODEL_HUB_ID
        if is_hub_id(model) and not Path(model).exists():
            return model
    return None


def model_card(manifest: dict[str, Any], artifacts: Sequence[Any], results: str | None) -> str:
    """The bundle's README.md: hub metadata (YAML front matter), what each artifact is and how it was made, how to
    apply the bundle, and the measured results it carries (a tuned_defaults artifact's validation) or is given."""
    base = manifest["base_model"]
    front = ["---", *([f"base_model: {base}"] if base else []), "library_name: kvcompile", "tags:"]
    front += [f"- {tag}" for tag in CARD_TAGS] + ["---", ""]
    model = manifest["model"]
    title = base.split("/")[-1] if base else model["architecture"]
    lines = [
        f"# kvcompile artifacts for {title}",
        "",
        "KV-cache compression statistics compiled offline by kvcompile for "
        f"{base or 'a local model'} ({model['architecture']}, {model['num_layers']} layers, "
        f"{model['num_query_heads']} query heads, {model['num_kv_heads']} KV heads, weights hash "
        f"`{model['weights_hash']}`). The runtime (`pip install kvruntime`) applies them inside `model.generate`; "
        "it refuses them for any other model.",
        "",
        "| file | kind | calibration data (sha256) | command |",
        "| --- | --- | --- | --- |",
    ]
    for entry in manifest["artifacts"]:
        provenance = entry["provenance"]
        corpus = provenance.get("calibration_data", "-")
        digest = str(provenance.get("calibration_sha256", ""))[:12]
        lines.append(
            f"| `{entry['file']}` | {entry['kind']} | {corpus} ({digest}) | `{provenance.get('command', '-')}` |"
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
    if results:
        lines += [results.strip(), ""]
    if not tuned and not results:
        lines += ["None carried: this bundle holds no tuned_defaults artifact and was given no results.", ""]
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
    """A tuned_defaults artifact's validation accuracy per method and ratio, as markdown."""
    from kvcompile.recipes.tuned_defaults.tuning import UNMEASURED  # a ratio not tried (past the tolerance)

    params, tensors = artifact.params, artifact.tensors
    ratios = [f"{r:g}" for r in tensors["ratios"].tolist()]
    prompts = artifact.provenance.get("validation_prompts", "?")
    lines = [
        f"Validation accuracy (`kvcompile tune`: {prompts} prompts of tasks {', '.join(params.get('tasks', []))}, "
        f"{'question-aware' if params.get('question_aware') else 'question-agnostic'}; calibration data "
        f"{artifact.provenance.get('calibration_data')}); full cache {tensors['full_accuracy'].item():.3f}:",
        "",
        "| method | " + " | ".join(ratios) + " |",
        "| --- |" + " --- |" * len(ratios),
    ]
    for method, row in zip(params.get("methods", []), tensors["accuracy"].tolist()):
        cells = [f"{value:.3f}" if value != UNMEASURED else "-" for value in row]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    recommended = params.get("recommended") or {}
    if recommended:
        lines += ["", f"Recommended (the runtime's default with this bundle): {recommended.get('method')} at ratio "
                  f"{recommended.get('ratio')}."]  # fmt: skip
    return lines + [""]


def reproduce(
    bundle: Bundle, kinds: Sequence[str], work: Path | None, echo: Callable[[str], None]
) -> list[tuple[str, str]]:
    """Rerun each chosen artifact's recorded command into a scratch folder (once per command: a companion such as
    CompilerKV's experience is written beside its main artifact) and compare the bytes with the bundle's: (file,
    verdict) per artifact, the verdict 'reproduced ...', 'differs: ...' or 'not reproducible: ...'."""
    from kvcompile.calibration.provenance import library_versions
    from kvcompile.recipes import RECIPES

    unknown = sorted(set(kinds) - {entry["kind"] for entry in bundle.entries})
    if unknown:
        raise KVRuntimeError(f"--only {unknown[0]}: the bundle holds {', '.join(bundle.kinds())}")
    chosen = [entry for entry in bundle.entries if not kinds or entry["kind"] in kinds]
    verdicts: dict[str, str] = {}
    runs: dict[str, list[dict[str, Any]]] = {}  # command -> its entries, the recipe's own artifact first
    for entry in chosen:
        provenance = entry.get("provenance") or {}
        if any(field not in provenance for field in REPRODUCIBLE_FIELDS):
            verdicts[entry["file"]] = "not reproducible: compiled before kvcompile recorded its full command"
            continue
        runs.setdefault(provenance["command"], []).append(entry)
    installed = library_versions()
    with tempfile.TemporaryDirectory(dir=work, prefix="kvcompile-reproduce-") as scratch:
        for command, entries in runs.items():
            entries.sort(key=lambda entry: entry["kind"] not in RECIPES)
            out = Path(scratch) / entries[0]["file"]
            arguments = [*shlex.split(command)[1:], "--out", str(out)]
            echo(f"{entries[0]['file']}: kvcompile {shlex.join(arguments)}")
            ran = subprocess.run([sys.executable, "-c", "from kvcompile.cli import main; main()", *arguments])
            for entry in entries:
                made = Path(scratch) / entry["file"]
                verdicts[entry["file"]] = _verdict(entry, made, ran.returncode, installed)
    return [(entry["file"], verdicts[entry["file"]]) for entry in chosen]


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
    """What `kvcompile info` prints for a bundle."""
    from kvruntime.fingerprint import ModelFingerprint

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
    return lines


def check_bundle_output(out: Path, sources: Sequence[Path]) -> None:
    """Refuse an --out that would replace something else than a bundle, or one of the sources."""
    if out.exists() and not (out.is_dir() and (is_bundle(out) or not any(out.iterdir()))):
        raise KVRuntimeError(f"--out {out} exists and is not a bundle: kvcompile replaces only its own bundles")
    resolved = out.resolve()
    for source in sources:
        inside = source.resolve()
        if resolved == inside or resolved in inside.parents or inside in resolved.parents:
            raise KVRuntimeError(f"--out {out} overlaps the source {source}: write the bundle to another folder")
