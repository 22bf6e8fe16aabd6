"""Writing files that other processes may read or write at the same time: atomic replacement with the umask's
modes, output checks made before any work, and per-path locks between processes. No torch here: the command line
checks its outputs before it imports the heavy runtime."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import KVRuntimeError


def umask_mode(mode: int) -> int:
    """`mode` less the process's umask: what `open` would give a new file (mkstemp and mkdtemp give 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """`write(temporary name)` in the target folder, fsync, then rename: the final name never holds half a file,
    and a reader sees the old file or the new one, whole."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(tmp_name)
        os.chmod(tmp_name, umask_mode(0o666))  # after the write: a writer may replace the file it was given
        with open(tmp_name, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def check_output_file(path: Path, option: str = "--out") -> None:
    """Refuse, before any work, an output file that cannot be written: a folder, or a folder we cannot write in."""
    if path.is_dir():
        raise KVRuntimeError(f"{option} {path} is a folder: give a file name")
    _check_writable_folder(_existing_ancestor(path.parent), f"{option} {path}")


def check_output_folder(path: Path, option: str = "--out") -> None:
    """Refuse, before any work, an output folder that is a file or cannot be written in."""
    if path.exists() and not path.is_dir():
        raise KVRuntimeError(f"{option} {path} is a file: give a folder")
    _check_writable_folder(_existing_ancestor(path), f"{option} {path}")


def _existing_ancestor(folder: Path) -> Path:
    folder = folder.absolute()
    while not folder.exists():
        folder = folder.parent
    return folder


def _check_writable_folder(folder: Path, what: str) -> None:
    if not folder.is_dir():
        raise KVRuntimeError(f"{what}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise KVRuntimeError(f"{what}: cannot write in {folder} (permission denied)")


def cache_root() -> Path:
    """kvcompile's cache: dequantised default models and locks ($KVCOMPILE_CACHE, else ~/.cache/kvcompile)."""
    return Path(os.environ.get("KVCOMPILE_CACHE", Path.home() / ".cache" / "kvcompile"))


@contextlib.contextmanager
def path_lock(path: Path, wait: bool) -> Iterator[None]:
    """Hold the lock of `path` across processes (a file under the cache's `locks/`, named after the absolute path,
    so that nothing is written beside the path itself). `wait`: block until it is free; else refuse at once when
    another process holds it. A no-op where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    target = str(Path(path).absolute())
    lock = cache_root() / "locks" / f"{Path(target).name}-{hashlib.sha256(target.encode()).hexdigest()[:16]}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise KVRuntimeError(
                f"another run is writing {path}: wait for it to finish, or give another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
