"""Artifact bundles: one folder per compiled model holding its artifacts, a manifest and a model card.

The manifest (`manifest.json`) names the model (its fingerprint) and, for each artifact file, its kind, the sha256
of its bytes and how it was made (the command that reruns it, the calibration data and its hash, the library
versions). `kvcompile bundle` writes a bundle, `kvcompile reproduce` reruns its commands. Wherever the runtime takes
artifacts (`compress(artifacts=...)`, `--artifact`, `--artifacts`, the kvpress presses' `from_artifact`) it also
takes a bundle, by its folder or by a hub repo id (`org/name`, found through huggingface_hub, from its local cache
when offline). A bundle whose files do not match its manifest, or whose artifacts were compiled for another model
than the manifest names, is refused before anything is applied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ArtifactError, first_line, printable, short_repr
from .artifact_header import (
    ARTIFACT_SUFFIX,
    artifact_file_name,
    check_artifact_file,
    header_of,
    load_json,
    open_plain_file,
)

MANIFEST_NAME = "manifest.json"
CARD_NAME = "README.md"
BUNDLE_FORMAT = "kvcompile-bundle"
BUNDLE_FORMAT_VERSION = 1
MANIFEST_MAX_BYTES = 4 << 20  # a manifest lists a few artifacts in kilobytes: a larger one is refused unread
MANIFEST_MAX_ENTRIES = 256  # a bundle holds one model's few artifacts; each listed file is read in full
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class Bundle:
    """A checked bundle: its folder, the model its artifacts were compiled for (a `ModelFingerprint`'s fields), and
    its manifest's entries (one per artifact file: `file`, `kind`, `sha256`, `provenance`)."""

    folder: Path
    model: dict[str, Any]
    entries: tuple[dict[str, Any], ...]
    manifest: dict[str, Any]

    def artifact_path(self, kind: str) -> Path:
        """The bundle's artifact of `kind`: the file named `<kind>.safetensors`, else the only one of that kind."""
        files = [entry["file"] for entry in self.entries if entry["kind"] == kind]
        if not files:
            raise ArtifactError(f"bundle {self.folder}: no {kind} artifact (it holds {', '.join(self.kinds())})")
        if len(files) > 1 and artifact_file_name(kind) not in files:
            raise ArtifactError(
                f"bundle {self.folder}: {len(files)} {kind} artifacts ({', '.join(files)}); give the file itself"
            )
        return self.folder / (artifact_file_name(kind) if len(files) > 1 else files[0])

    def kinds(self) -> list[str]:
        return sorted({entry["kind"] for entry in self.entries})

    def artifact_files(self) -> list[Path]:
        """One artifact per kind (`artifact_path`): what the runtime applies from the bundle."""
        return [self.artifact_path(kind) for kind in self.kinds()]


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a plain file's bytes (`open_plain_file`: a link, a FIFO or a device is refused)."""
    with open_plain_file(path) as handle:
        return _sha256(handle)


def _sha256(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def locate(source: str | os.PathLike) -> Path:
    """A local path as given, else a hub repo id's folder in the Hugging Face cache (huggingface_hub fetches it when
    online; offline, `HF_HUB_OFFLINE=1`, only the cache is read)."""
    path = Path(source)
    if path.exists() or not is_hub_id(str(source)):
        return path
    if path.parent.is_dir():  # `dir/bundle` beside a folder `dir`: a mistyped path, not a hub id to look up
        raise ArtifactError(f"{source}: no such file or folder (its folder {path.parent} is here)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=str(source)))
    except Exception as exc:  # huggingface_hub raises several types for a repo that is neither cached nor reachable
        raise ArtifactError(
            f"{source}: no such file or folder, and no hub repo of that id in the local Hugging Face cache "
            f"({first_line(exc)})"
        ) from None


def is_hub_id(text: str) -> bool:
    """Whether `text` has the shape of a hub repo id (`org/name`)."""
    return _HUB_ID.fullmatch(text) is not None


def is_bundle(folder: Path) -> bool:
    """Whether `folder` holds a manifest (a bundle's; `read_bundle` checks it). Any file of that name counts: one that
    is a link, a FIFO or a device is the bundle's, refused as such when read, not a folder without one."""
    return os.path.lexists(folder / MANIFEST_NAME)


def read_bundle(source: str | os.PathLike) -> Bundle:
    """Read a bundle (a folder or a hub repo id) and check it: a manifest of this format, every listed file present
    with the bytes its sha256 names, of the kind and model the manifest says, and no artifact file it leaves out."""
    folder = locate(source)
    if not is_bundle(folder):
        raise ArtifactError(f"{source}: not a bundle (no {MANIFEST_NAME}; `kvcompile bundle` writes one)")
    manifest = _read_manifest(folder / MANIFEST_NAME)
    model = manifest["model"]
    listed = {entry["file"] for entry in manifest["artifacts"]}
    for entry in manifest["artifacts"]:
        path = folder / entry["file"]
        if path.is_symlink():  # it could lead out of the bundle
            raise ArtifactError(f"bundle {source}: {entry['file']} is a symbolic link, not a file of the bundle")
        if not path.is_file():
            raise ArtifactError(f"bundle {source}: {entry['file']} is listed in its manifest but missing")
        header = _checked_header(path, entry, source)
        if header.get("kind") != entry["kind"]:
            raise ArtifactError(
                f"bundle {source}: {entry['file']} is a {printable(header.get('kind'))} artifact, its manifest says {entry['kind']}"
            )
        if header.get("model") != json.dumps(model, sort_keys=True):
            raise ArtifactError(f"bundle {source}: {entry['file']} was compiled for another model than its manifest's")
    unlisted = sorted(p.name for p in folder.glob(f"*{ARTIFACT_SUFFIX}") if p.name not in listed)
    if unlisted:
        raise ArtifactError(
            f"bundle {source}: {unlisted[0]} is not in its manifest (rewrite it with `kvcompile bundle`)"
        )
    return Bundle(folder, model, tuple(manifest["artifacts"]), manifest)


def _checked_header(path: Path, entry: dict[str, Any], source: str | os.PathLike) -> dict[str, str]:
    """The metadata of a listed artifact file whose bytes match the manifest's sha256: the file itself (never a
    link) opened once, so that the header read is that of the bytes checked."""
    with open_plain_file(path) as handle:
        if _sha256(handle) != entry["sha256"]:
            raise ArtifactError(f"bundle {source}: {entry['file']} does not match its manifest (sha256 differs)")
        handle.seek(0)
        return header_of(handle, path)[0]["__metadata__"]


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, checked field by field: it may come from anyone, so every value later used as a path, printed
    or compared has the type and shape expected (a file is a plain name in the bundle, text is printable)."""
    try:
        with open_plain_file(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MANIFEST_MAX_BYTES:
                raise ValueError(f"{size} bytes, more than a manifest's {MANIFEST_MAX_BYTES}")
            text = handle.read(MANIFEST_MAX_BYTES + 1)  # bounded even if it grew since
        manifest = load_json(text.decode("utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError, ArtifactError) as exc:
        raise ArtifactError(f"{path}: not a readable manifest ({printable(first_line(exc))})") from None
    if manifest.get("format") != BUNDLE_FORMAT:
        raise ArtifactError(f"{path}: not a kvcompile bundle manifest (format {short_repr(manifest.get('format'))})")
    if manifest.get("format_version") != BUNDLE_FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: bundle format version {short_repr(manifest.get('format_version'))}, this kvruntime reads "
            f"version {BUNDLE_FORMAT_VERSION}"
        )
    problem = manifest_problem(manifest)
    if problem:
        raise ArtifactError(f"{path}: malformed manifest ({problem})")
    return manifest


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields, or None."""
    from .fingerprint import ModelFingerprint

    try:
        ModelFingerprint.from_dict(manifest.get("model"))
    except ValueError as exc:
        return f"its model: {first_line(exc)}"
    for key in ("base_model", "created", "bundled_by"):
        if manifest.get(key) is not None and not _is_text(manifest[key]):
            return f"{key} is not a line of printable text"
    entries = manifest.get("artifacts")
    if not isinstance(entries, list) or not entries:
        return "needs a list of artifacts"
    if len(entries) > MANIFEST_MAX_ENTRIES:
        return f"{len(entries)} artifact entries, more than a bundle's {MANIFEST_MAX_ENTRIES}"
    files: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            return "an artifact entry is not an object"
        for key in ("file", "picture"):
            if (key == "file" or key in entry) and not is_plain_name(entry.get(key)):
                return f"an artifact's {key} is not a file name in the bundle"
        if entry["file"] in files:  # each listed file is read in full: listed twice, it would be read twice
            return f"it lists {entry['file']} twice"
        files.add(entry["file"])
        if not _is_text(entry.get("kind")) or not isinstance(entry.get("sha256"), str):
            return f"{entry['file']} needs a kind and a sha256"
        if not _SHA256.fullmatch(entry["sha256"]):
            return f"{entry['file']}'s sha256 is not 64 hexadecimal digits"
        for key in ("provenance", "params", "run"):
            if entry.get(key) is not None and not isinstance(entry[key], dict):
                return f"{entry['file']}'s {key} is not an object"
        provenance = entry.get("provenance") or {}
        if "command" in provenance and not _is_text(provenance["command"]):
            return f"{entry['file']}'s command is not a line of printable text"
        libraries = provenance.get("libraries", {})
        if not isinstance(libraries, dict) or not all(isinstance(v, str) for v in libraries.values()):
            return f"{entry['file']}'s libraries are not names and versions"
    return None if manifest.get("results") is None else results_problem(manifest["results"])


def results_problem(results: object) -> str | None:
    """What is wrong with the measured results a bundle carries (`kvcompile bundle --results`), or None: a source
    and a command of printable text, a count, a table of rows whose cells are text, finite numbers or empty, and a
    picture that is a file of the bundle."""
    if not isinstance(results, dict):
        return "its results are not an object"
    if not _is_text(results.get("source")) or not _is_count(results.get("prompts")):
        return "its results need a source and a count of prompts"
    if results.get("command") is not None and not _is_text(results["command"]):
        return "its results' command is not a line of printable text"
    if "picture" in results and not is_plain_name(results["picture"]):
        return "its results' picture is not a file name in the bundle"
    table = results.get("table")
    if not isinstance(table, list) or not all(isinstance(row, dict) for row in table):
        return "its results' table is not a list of rows"
    for row in table:
        for key, value in row.items():
            cell = value is None or _is_text(value) or _is_finite(value)
            if not _is_text(key) or not cell:
                return "its results' table holds a cell that is not text, a finite number or empty"
    return None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_text(value: object) -> bool:
    return isinstance(value, str) and value.isprintable()


def is_plain_name(name: object) -> bool:
    """Whether `name` names a file directly in a folder: no separator, not `.` or `..`, printable."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and Path(name).name == name
        and "\\" not in name
        and name.isprintable()
    )


def beside(artifact: Path, names: object, what: str) -> list[Path]:
    """The files an artifact names by `names` (a list of file names), beside it: each a plain name, and where the
    artifact sits in a bundle, a file of that bundle (in its manifest, its bytes checked). A name that would lead
    elsewhere is refused: an artifact may come from anyone."""
    if not isinstance(names, list) or not all(is_plain_name(name) for name in names):
        raise ArtifactError(f"{artifact}: {what} names a file outside its folder (give plain file names)")
    folder = artifact.parent
    if is_bundle(folder):
        listed = {entry["file"] for entry in read_bundle(folder).entries}
        unlisted = [name for name in names if name not in listed]
        if unlisted:
            raise ArtifactError(f"{artifact}: {what} names {printable(unlisted[0])}, which its bundle does not hold")
    return [folder / name for name in names]


def resolve_artifact_path(source: str | os.PathLike, kind: str) -> Path:
    """The artifact of `kind` that `source` names: an artifact file as given; in a bundle (a folder or a hub repo
    id) its artifact of that kind; in a plain folder of artifacts (`artifacts/<model>/`) `<kind>.safetensors`."""
    folder = locate(source)
    if not folder.exists():
        raise ArtifactError(f"{source}: no such artifact file, bundle or folder")
    if not folder.is_dir():
        return folder
    if is_bundle(folder):
        return read_bundle(folder).artifact_path(kind)
    found = folder / artifact_file_name(kind)
    if not found.is_file():
        raise ArtifactError(f"{folder}: no {kind} artifact in this folder (expected {found})")
    return found


def artifact_files(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """The artifact files that `sources` name: files as given, each bundle (a folder or a hub repo id) as one
    artifact per kind, and each plain folder of artifacts (`artifacts/<model>/`, a store folder) as its
    `<kind>.safetensors` files."""
    from .artifact_kinds import KNOWN_KINDS

    files: list[Path] = []
    for source in sources:
        path = locate(source)
        if path.is_dir() and is_bundle(path):
            files += read_bundle(path).artifact_files()
        elif path.is_dir():
            found = [path / artifact_file_name(kind) for kind in KNOWN_KINDS]
            held = [check_artifact_file(file) for file in found if os.path.lexists(file)]
            if not held:
                raise ArtifactError(
                    f"{source} is a folder without artifacts: give an artifact file (.safetensors), a folder of "
                    f"<kind>.safetensors files or a bundle (written by `kvcompile bundle`)"
                )
            files += held
        else:
            files.append(check_artifact_file(path))
    return files
