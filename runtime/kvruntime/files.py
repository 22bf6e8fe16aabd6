"""Writing files that other processes may read or write at the same time: atomic replacement with the umask's
modes, output checks made before any work, and per-path locks between processes. No torch here: the command line
checks its outputs before it imports the heavy runtime."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import KVRuntimeError, first_line


def umask_mode(mode: int) -> int:
    """`mode` less the process's umask: what `open` would give a new file (mkstemp and mkdtemp give 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under `folder`."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """`write(temporary name)` in the target folder, fsync, then rename: the final name never holds half a file,
    and a reader sees the old file or the new one, whole. A failed write (a full disk, a folder removed or made
    read-only meanwhile) leaves no temporary file and is one `KVRuntimeError` naming the file."""
    target = Path(path)
    tmp_name = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        write(tmp_name)
        os.chmod(tmp_name, umask_mode(0o666))  # after the write: a writer may replace the file it was given
        with open(tmp_name, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException as exc:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise KVRuntimeError(f"cannot write {target}: {exc.strerror or first_line(exc)}") from None
        raise
    return target


def replace_folder(folder: Path, write: Callable[[Path], None]) -> Path:
    """`write(staging)` fills an empty staging folder beside `folder`, whose files then get the umask's modes, and
    the staging folder takes `folder`'s name: the old one is set aside, the new one renamed in, and only then the
    old one removed, so that a reader finds the old folder or the new one, whole. A failure or an interrupt at any
    point leaves one of them under `folder`'s name (the old one put back when the swap did not finish) and no
    staging folder; what a killed run left beside `folder` is cleared (or put back) by the next one. The caller
    serialises concurrent writers."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(folder)
    staging_prefix, retired_prefix = _leftover_prefixes(folder)
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix, dir=folder.parent))
    retired = folder.with_name(f"{retired_prefix}{uuid.uuid4().hex[:8]}")
    try:
        write(staging)
        share_like_any_file(staging)
        if folder.exists():
            os.replace(folder, retired)
        os.replace(staging, folder)
    except BaseException:
        if retired.exists() and not folder.exists():  # interrupted between the two renames: the old one goes back
            os.replace(retired, folder)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(retired, ignore_errors=True)
    return folder


def _leftover_prefixes(folder: Path) -> tuple[str, str]:
    """The names' starts of `folder`'s staging folders and of its old one set aside."""
    return f".{folder.name}.partial-", f".{folder.name}.stale-"


def _clear_leftovers(folder: Path) -> None:
    """Remove the staging folders and old folders a killed `replace_folder` left beside `folder`, putting an old
    one back first when `folder` itself is missing (killed between the two renames)."""
    staging_prefix, retired_prefix = _leftover_prefixes(folder)
    found = sorted(p for p in folder.parent.iterdir() if p.name.startswith((staging_prefix, retired_prefix)))
    retired = [p for p in found if p.name.startswith(retired_prefix) and p.is_dir() and not p.is_symlink()]
    if retired and not folder.exists() and not folder.is_symlink():
        os.replace(retired[0], folder)
        found.remove(retired[0])
    for leftover in found:
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def share_like_any_file(folder: Path) -> None:
    """Give the folder and its files the umask's modes (mkdtemp and some writers make them private)."""
    folder.chmod(umask_mode(0o777))
    for path in folder.iterdir():
        path.chmod(umask_mode(0o666))


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
    """Try it: create and remove a file in `folder` (permission bits say nothing of /proc, a read-only mount or a
    full disk)."""
    if not folder.is_dir():
        raise KVRuntimeError(f"{what}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvcompile-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise KVRuntimeError(f"{what}: cannot write in {folder} ({exc.strerror or first_line(exc)})") from None


def cache_root() -> Path:
    """kvcompile's cache: dequantised models, compiled artifacts and locks ($KVCOMPILE_CACHE, else
    ~/.cache/kvcompile; an empty one counts as unset, never as the current folder), as an absolute path."""
    given = os.environ.get("KVCOMPILE_CACHE", "").strip()
    return Path(given).expanduser().absolute() if given else Path.home() / ".cache" / "kvcompile"


@contextlib.contextmanager
def path_lock(path: Path, wait: bool) -> Iterator[None]:
    """Hold the lock of `path` across processes (a file under the cache's `locks/`, named after the resolved path,
    so that nothing is written beside the path itself). `wait`: block until it is free; else refuse at once when
    another process holds it. A no-op where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    # Resolved (links and `..` followed as the system does): `x/../b` and a path through a linked folder name the
    # folder they write, so runs that spell it differently take the same lock.
    target = os.path.realpath(path)
    lock = cache_root() / "locks" / f"{Path(target).name}-{hashlib.sha256(target.encode()).hexdigest()[:16]}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KVRuntimeError(f"cannot create the lock folder {lock.parent}: {exc.strerror}") from None
    handle = _locked(lock, fcntl, wait, path)
    try:
        yield
    finally:
        # Removed while still held: a process that opened the old file before this unlink finds, once it has the
        # lock, that its file is no longer the one under the name, and starts again (`_locked`).
        lock.unlink(missing_ok=True)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _locked(lock: Path, fcntl: object, wait: bool, path: Path) -> object:
    """An open handle on `lock`, flocked, that is still the file under that name (lock files are removed on
    release, so a lock taken on a file just unlinked is taken again on the new one)."""
    while True:
        handle = open(lock, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            raise KVRuntimeError(
                f"another run is writing {path}: wait for it to finish, or give another --out"
            ) from None
        try:
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(handle.fileno())):
            return handle
        handle.close()  # releases the stale lock
