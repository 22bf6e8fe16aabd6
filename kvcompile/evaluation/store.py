"""The records of an evaluation run, kept in its output folder so that an interrupted run can be resumed:
`run.json` (the settings) and `runs.jsonl` (one record per prompt x contestant x ratio), both rewritten
atomically after each prompt's work. Nothing is written before the first records (a run refused at the start
leaves no folder behind)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from kvcompile.json_text import NotJSON, parse_json
from kvruntime import KVRuntimeError
from kvruntime.files import write_atomically

RUN_FILES = ("run.json", "runs.jsonl")


def check_run_folder(folder: Path, option: str = "--out") -> None:
    """A run writes into a folder that is new, empty, or an earlier run's (it holds runs.jsonl): never into a
    folder of other files, whose names its reports could take."""
    if folder.is_dir() and not (folder / "runs.jsonl").is_file() and any(folder.iterdir()):
        raise KVRuntimeError(
            f"{option} {folder} holds files that are not a kvcompile run's: give a new or empty folder"
        )


def discard_run_records(folder: Path) -> None:
    """Remove the records a run kept in `folder`, and the folder if nothing else is in it."""
    for name in RUN_FILES:
        (folder / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: what else is there is not ours to remove
        folder.rmdir()


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp_name: Path(tmp_name).write_text(text))


# What a record needs for resuming (`RunStore.key`); the report reads the rest.
RECORD_KEYS = {"prompt": ((int,), "an integer"), "method": ((str,), "a string"), "ratio": ((int, float), "a number")}
RESUMING = ("cannot resume from {path}", "run again without --resume into a new --out")  # (what failed, what to do)
BUNDLING = ("cannot bundle the eval results in {path}", "give the --out folder of a kvcompile eval run")


def _unreadable(path: Path, problem: str, reading: tuple[str, str] = RESUMING) -> KVRuntimeError:
    failed, hint = reading
    return KVRuntimeError(f"{failed.format(path=path)}: {problem}; {hint}")


def _parse_json(path: Path, text: str, where: str = "", reading: tuple[str, str] = RESUMING) -> object:
    """`text` parsed, or one line naming `path` (and `where` in it) and the problem."""
    try:
        return parse_json(text, one_line=bool(where))
    except NotJSON as exc:
        problem = f"{where}{exc}"
    raise _unreadable(path, problem, reading)  # outside the handler: the parser's traceback adds nothing to the line


def _read_utf8(path: Path, reading: tuple[str, str] = RESUMING) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise _unreadable(path, "it is not UTF-8 text", reading) from None
    except OSError as exc:
        raise _unreadable(path, exc.strerror or str(exc), reading) from None


def read_saved_settings(path: Path, reading: tuple[str, str] = RESUMING) -> dict:
    """The settings an earlier run saved in `path` (run.json): a JSON object, or one line saying why not (what
    failed and what to do: `reading`)."""
    saved = _parse_json(path, _read_utf8(path, reading), reading=reading)
    if not isinstance(saved, dict):
        problem = f"it holds a JSON {type(saved).__name__}, not the run's settings (an object)"
        raise _unreadable(path, problem, reading)
    return saved


def read_saved_records(
    path: Path, reading: tuple[str, str] = RESUMING, keys: dict[str, tuple[tuple[type, ...], str]] = RECORD_KEYS
) -> list[dict]:
    """The records an earlier run saved in `path` (runs.jsonl, one JSON object per line), or one line naming the
    first line that is not a record (one holding each of `keys` of its type)."""
    records = []
    # Split on newlines only: json.dumps escapes every other line break, so none is inside a record.
    for number, line in enumerate(_read_utf8(path, reading).split("\n"), 1):
        if not line.strip():
            continue
        where = f"line {number} "
        record = _parse_json(path, line, where, reading)
        if not isinstance(record, dict):
            raise _unreadable(path, f"{where}is not a run record (a JSON object)", reading)
        for key, (types, kind) in keys.items():
            value = record.get(key)
            if not isinstance(value, types) or isinstance(value, bool):
                problem = f"{where}is not a run record (its {key} is missing or not {kind})"
                raise _unreadable(path, problem, reading)
        records.append(record)
    return records


def _grows(saved: object, given: object) -> bool:
    """Whether the list `given` holds every item of `saved` (an extendable setting that grew or stayed)."""
    if not isinstance(saved, list | None) or not isinstance(given, list | None):
        return False
    try:
        return set(saved or []) <= set(given or [])
    except TypeError:  # unhashable items: not a list of names, so not one that grew
        return False


class RunStore:
    """`extendable`: settings whose lists may grow on resume (methods added to an earlier run: only their runs are
    made); every other setting must be the same."""

    def __init__(self, folder: Path, settings: dict, resume: bool, extendable: tuple[str, ...] = ()) -> None:
        check_run_folder(folder)
        self.folder = folder
        self.records: list[dict] = []
        settings_path, runs_path = (folder / name for name in RUN_FILES)
        if runs_path.exists() and not resume:
            raise KVRuntimeError(
                f"{folder} holds the records of an earlier run: pass --resume to continue it, or another --out"
            )
        if resume and runs_path.exists():
            saved = read_saved_settings(settings_path) if settings_path.exists() else {}
            given = json.loads(json.dumps(settings))
            changed = sorted(
                k
                for k in set(saved) | set(given)
                if saved.get(k) != given.get(k) and not (k in extendable and _grows(saved.get(k), given.get(k)))
            )
            if changed:
                raise KVRuntimeError(
                    f"{folder} holds a run with other settings ({', '.join(changed)} differ): use another --out"
                )
            self.records = read_saved_records(runs_path)
        self._keys = {self.key(r["prompt"], r["method"], r["ratio"]) for r in self.records}
        self._settings = settings
        self._settings_path, self._runs_path = settings_path, runs_path

    @staticmethod
    def key(prompt: int, label: str, ratio: float) -> tuple:
        return prompt, label, round(ratio, 6)

    def done(self, prompt: int, label: str, ratio: float) -> bool:
        return self.key(prompt, label, ratio) in self._keys

    def add(self, records: list[dict]) -> None:
        self.records += records
        self._keys |= {self.key(r["prompt"], r["method"], r["ratio"]) for r in records}
        write_text_atomically(self._settings_path, json.dumps(self._settings, indent=1, sort_keys=True) + "\n")
        write_text_atomically(self._runs_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records))
