"""The records of an evaluation run, kept in its output folder so that an interrupted run can be resumed:
`run.json` (the settings) and `runs.jsonl` (one record per prompt x contestant x ratio), both rewritten
atomically after each prompt's work. Nothing is written before the first records (a run refused at the start
leaves no folder behind)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

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
            saved = json.loads(settings_path.read_text()) if settings_path.exists() else {}
            given = json.loads(json.dumps(settings))
            changed = sorted(
                k
                for k in set(saved) | set(given)
                if saved.get(k) != given.get(k)
                and not (k in extendable and set(saved.get(k) or []) <= set(given.get(k) or []))
            )
            if changed:
                raise KVRuntimeError(
                    f"{folder} holds a run with other settings ({', '.join(changed)} differ): use another --out"
                )
            self.records = [json.loads(line) for line in runs_path.read_text().splitlines() if line.strip()]
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
