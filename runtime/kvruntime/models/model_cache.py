"""The model cache's files: a GGUF's converted model in a folder keyed by the weights' content (`cache_folder`),
built under a lock into a staging folder and marked complete last (`ensure_cache`), the files' hashes recorded
against their identity (`content_sha256`). No torch, no transformers: what is cached is `default_model`'s."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ..files import cache_root, path_lock, replace_folder, write_atomically

# Raised whenever what is written into the cache changes, so that older folders are never read (3: keyed by content;
# 4: a SentencePiece tokenizer built from the GGUF, not converted by transformers).
CACHE_FORMAT = 4
MARKER = "kvcompile_cache.json"  # written last: a folder without it is incomplete
SETTLED_SECONDS = 3  # a file unchanged for this long has a recordable identity (`content_sha256`)


def cache_folder(gguf: Path, versions: dict[str, str]) -> Path:
    """The cache folder of this GGUF's weights as these library versions convert them: keyed by the file's whole
    content (`content_sha256`), so one set of weights is cached once however it is named or given, and a file of the
    same name and size with other tensors gets a folder of its own."""
    return cache_root() / "models" / cache_key(content_sha256(gguf), versions)


def cache_key(sha256: str, versions: dict[str, str]) -> str:
    """A cache folder's name: the weights' sha256 and what shapes their conversion."""
    settings = json.dumps({"format": CACHE_FORMAT, "weights_sha256": sha256, **versions}, sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes, recorded in the cache against the file's identity (device, inode, size, times): a
    file rewritten, replaced or touched is hashed again (about a second per 500 MB), one left alone is read once per
    machine. A file changed in the last seconds is not recorded (git's "racy" rule: a rewrite within the
    filesystem's time granule would keep its identity)."""
    stat = path.stat()
    identity = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    record = cache_root() / "hashes" / hashlib.sha256(f"{path.resolve()}|{identity}".encode()).hexdigest()[:32]
    try:
        known = json.loads(record.read_text())
        if isinstance(known, dict) and known.get("identity") == identity and isinstance(known.get("sha256"), str):
            return known["sha256"]
    except (OSError, ValueError):
        pass
    sha256 = file_sha256(path)
    if time.time() - max(stat.st_mtime, stat.st_ctime) > SETTLED_SECONDS:
        text = json.dumps({"identity": identity, "sha256": sha256})
        write_atomically(record, lambda tmp_name: Path(tmp_name).write_text(text))
    return sha256


def read_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    complete = isinstance(marker, dict) and marker.get("format") == CACHE_FORMAT
    return marker if complete and (folder / "config.json").exists() else None


def ensure_cache(folder: Path, build: Callable[[Path], dict], stale_build: str | None = None) -> dict:
    """The marker of a complete cache in `folder`, building it first if it is missing, incomplete, or (with
    `stale_build`) still the build of that id, which failed its check. `build(staging)` writes the files into an
    empty staging folder and returns the marker's contents."""
    marker = read_marker(folder)
    if marker is not None and marker.get("build") != stale_build:
        return marker
    folder.parent.mkdir(parents=True, exist_ok=True)
    with path_lock(folder, wait=True):  # one builder at a time; the others find its cache
        marker = read_marker(folder)  # another process may have finished while we waited
        if marker is not None and marker.get("build") != stale_build:
            return marker
        built: dict = {}

        def write(staging: Path) -> None:
            built.update(format=CACHE_FORMAT, build=uuid.uuid4().hex, **build(staging))
            (staging / MARKER).write_text(json.dumps(built, indent=2, sort_keys=True))

        # An incomplete cache, or one that failed its check, is replaced; a killed build's staging folder removed.
        replace_folder(folder, write)
    return built
