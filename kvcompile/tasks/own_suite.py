"""A user's own suite (`kvcompile eval --suite`, `kvcompile tune --suite`): prompts read from a JSON Lines file (one
object a line: `context`, `question`, `answers`, optional `answer_prefix` and `id`) or a folder of the same rows
(saved by `datasets`' `save_to_disk`, or .jsonl/.json/.parquet files). Every row is checked before torch loads and
a bad one refused in one line that names it; the file's text is never printed (it may be hostile).

A folder is read as a folder of the user's files, not through `datasets` (which follows its metadata wherever it
points and keeps a copy of the rows in its own cache): every file its metadata names is a plain file directly in it
(no `..`, absolute path or link out), special files are refused before they are opened, JSON goes through the run
store's bounded reader, Arrow and Parquet tables have their columns checked before their rows are read, and the
suite's digest covers exactly the bytes read."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvcompile.evaluation.store import NotJSON, parse_json
from kvruntime import KVRuntimeError
from kvruntime.artifacts.bundle import is_plain_name
from kvruntime.errors import printable, short_repr

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvcompile.tasks.retrieval import TaskPrompt

FIELDS = ("context", "question", "answers", "answer_prefix", "id")
_TABLE_FILES = (".jsonl", ".json", ".parquet")
# What `save_to_disk` writes: a dataset's folder holds state.json (its Arrow files) beside dataset_info.json; a
# DatasetDict's folder holds dataset_dict.json (its splits, each a dataset's folder inside it).
_DATASET_STATE, _DATASET_DICT = "state.json", "dataset_dict.json"


@dataclasses.dataclass(frozen=True)
class SuiteRow:
    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    answer_prefix: str = ""
    where: str = ""  # 'suite.jsonl line 3': how a refusal names it


@dataclasses.dataclass(frozen=True)
class Suite:
    rows: tuple[SuiteRow, ...]
    sha256: str  # of the bytes its rows were read from (each file's name and bytes, in the order read)


def read_suite(path: Path) -> Suite:
    """The rows of a suite file or folder, each checked (`suite_row`); refuses an empty suite and repeated ids."""
    files = _SuiteFiles(path)
    rows = [suite_row(raw, where) for raw, where in _raw_rows(path, files)]
    if not rows:
        raise KVRuntimeError(f"--suite {path}: no prompt in it")
    seen: dict[str, str] = {}
    for row in rows:
        if row.id in seen:
            raise KVRuntimeError(f"{row.where}: id {short_repr(row.id)} is also {seen[row.id]}'s: give each its own")
        seen[row.id] = row.where
    return Suite(tuple(rows), files.digest.hexdigest())


def suite_row(raw: object, where: str) -> SuiteRow:
    """One row checked: only the known fields, a non-empty `context` and `question`, `answers` a non-empty list of
    strings non-empty once stripped (kept stripped: a scoring compares them with the answer's words), `answer_prefix`
    a string, `id` a string or a whole number (the row's place when absent)."""
    if not isinstance(raw, Mapping):
        raise KVRuntimeError(f"{where}: not an object with the fields {', '.join(FIELDS[:3])}")
    unknown = sorted(printable(key) for key in raw if key not in FIELDS)
    if unknown:
        raise KVRuntimeError(f"{where}: unknown field {short_repr(unknown[0])} (known: {', '.join(FIELDS)})")
    for field in ("context", "question"):
        value = raw.get(field)
        if not isinstance(value, str) or not value.strip():
            raise KVRuntimeError(f"{where}: no {field!r} (give a non-empty string)")
    answers = raw.get("answers")
    if isinstance(answers, str):
        raise KVRuntimeError(f"{where}: 'answers' is a string: give a list of the accepted answers")
    if not isinstance(answers, list | tuple) or not answers:
        raise KVRuntimeError(f"{where}: no 'answers' (give a non-empty list of the accepted answers)")
    if not all(isinstance(answer, str) and answer.strip() for answer in answers):
        raise KVRuntimeError(f"{where}: every one of 'answers' must be a non-empty string")
    prefix = raw.get("answer_prefix") or ""
    if not isinstance(prefix, str):
        raise KVRuntimeError(f"{where}: 'answer_prefix' must be a string")
    given = raw.get("id")
    given = None if given == "" else given  # a table's column leaves it empty where a row has none
    if given is not None and (isinstance(given, bool) or not isinstance(given, str | int)):
        raise KVRuntimeError(f"{where}: 'id' must be a string or a whole number")
    row_id = str(given) if given is not None else " ".join(where.rsplit(" ", 2)[-2:])  # 'line 3', 'row 3'
    answers = tuple(answer.strip() for answer in answers)
    return SuiteRow(row_id, raw["context"], raw["question"], answers, prefix, where)


class _SuiteFiles:
    """The suite's files, read whole, once each: a plain file (not a FIFO, a device or a link) inside the suite,
    its name and bytes added to the digest in the order read."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.digest = hashlib.sha256()
        try:
            mode = os.stat(root).st_mode  # the path the user typed may be a link of theirs; what it holds may not
        except OSError:
            raise KVRuntimeError(f"--suite {root}: no such file or folder") from None
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise KVRuntimeError(f"--suite {root}: not a file or a folder (a FIFO or a device is not read)")

    def read(self, relative: str = "") -> bytes:
        """The bytes of the file `relative` (names separated by '/', each checked by the caller), or of the suite
        itself when it is a file."""
        path = self.root.joinpath(*relative.split("/")) if relative else self.root
        flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if relative else 0)  # a FIFO put in its place never blocks
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            problem = "a symbolic link" if os.path.islink(path) else exc.strerror or "unreadable"
            raise KVRuntimeError(f"--suite {self.root}: {printable(relative or path.name)}: {problem}") from None
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise KVRuntimeError(f"--suite {self.root}: {printable(relative or path.name)} is not a plain file")
            data = handle.read()
        name = (relative or path.name).encode("utf-8", "surrogateescape")
        self.digest.update(len(name).to_bytes(8, "big") + name + len(data).to_bytes(8, "big") + data)
        return data

    def listing(self, relative: str = "") -> list[str]:
        """The names in the folder `relative`, which must be a folder inside the suite, not a link to one."""
        path = self.root.joinpath(*relative.split("/")) if relative else self.root
        if relative and (path.is_symlink() or not path.is_dir()):
            raise KVRuntimeError(f"--suite {self.root}: {printable(relative)} is not a folder of the suite")
        return sorted(os.listdir(path))

    def text(self, relative: str, where: str) -> str:
        try:
            return self.read(relative).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KVRuntimeError(f"{where}: not UTF-8 text (byte {exc.start})") from None

    def json(self, relative: str) -> object:
        where = f"--suite {self.root}: {relative}"
        try:
            return parse_json(self.text(relative, where))
        except NotJSON as exc:
            raise KVRuntimeError(f"{where} {exc}") from None


def _raw_rows(path: Path, files: _SuiteFiles) -> Iterator[tuple[object, str]]:
    """(row, where) of every row: a JSON Lines file line by line (blank lines skipped), a folder's tables."""
    if path.is_dir():
        yield from _folder_rows(path, files)
        return
    if path.suffix != ".jsonl":
        raise KVRuntimeError(f"--suite {path}: give a .jsonl file or a folder saved by datasets")
    yield from _json_lines(files.text("", f"--suite {path}"), path.name, "line", 1)


def _json_lines(text: str, name: str, unit: str, first: int) -> Iterator[tuple[object, str]]:
    """The rows of JSON Lines `text`, each named '`name` `unit` N' (N from `first`, counting every line)."""
    # Split on newlines only: a JSON text escapes every other line break.
    for number, line in enumerate(text.split("\n"), start=first):
        if not line.strip():
            continue
        where = f"{name} {unit} {number}"
        try:
            yield parse_json(line, one_line=True), where
        except NotJSON as exc:
            raise KVRuntimeError(f"{where}: {str(exc).removeprefix('is ')}") from None


def _folder_rows(folder: Path, files: _SuiteFiles) -> Iterator[tuple[object, str]]:
    """The rows of a folder saved by `datasets` (one split, or a dict of splits of which `test` or the only one is
    read) or of its .jsonl/.json/.parquet files (of one kind: JSON or Parquet), numbered across the files."""
    names = files.listing()
    if _DATASET_DICT in names:
        splits = files.json(_DATASET_DICT)
        splits = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(splits, list) or not splits or not all(is_plain_name(s) for s in splits):
            raise KVRuntimeError(f"--suite {folder}: {_DATASET_DICT} lists no splits that are folders inside it")
        split = "test" if "test" in splits else splits[0] if len(splits) == 1 else None
        if split is None:
            shown = [printable(s) for s in sorted(splits)]
            raise KVRuntimeError(f"--suite {folder}: splits {shown} and none is 'test': save one split")
        tables = _dataset_tables(files, split, files.listing(split))
    elif _DATASET_STATE in names:
        tables = _dataset_tables(files, "", names)
    else:
        tables = [name for name in names if Path(name).suffix in _TABLE_FILES]
        if not tables:
            raise KVRuntimeError(f"--suite {folder}: no dataset saved by datasets, no .jsonl, .json or .parquet file")
        if len({Path(name).suffix == ".parquet" for name in tables}) > 1:
            raise KVRuntimeError(f"--suite {folder}: mixes parquet and json files: keep one format")
    index = 0
    for name in tables:
        for row in _table_rows(files, name):
            index += 1
            yield row, f"{folder.name} row {index}"


def _dataset_tables(files: _SuiteFiles, split: str, names: list[str]) -> list[str]:
    """The Arrow files a saved dataset's state.json names, each a plain file of its folder."""
    state_path = f"{split}/{_DATASET_STATE}" if split else _DATASET_STATE
    if _DATASET_STATE not in names:
        raise KVRuntimeError(f"--suite {files.root}: no {state_path} (save the split with datasets' save_to_disk)")
    state = files.json(state_path)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise KVRuntimeError(f"--suite {files.root}: {state_path} names no data files")
    tables = [entry.get("filename") for entry in entries]
    outside = next((name for name in tables if not is_plain_name(name) or Path(name).suffix != ".arrow"), None)
    if outside is not None:
        raise KVRuntimeError(
            f"--suite {files.root}: {state_path} names {short_repr(outside)}: a suite's data files are .arrow "
            "files inside its folder"
        )
    return [f"{split}/{name}" if split else name for name in tables]


def _table_rows(files: _SuiteFiles, name: str) -> list[object]:
    """The rows of one table file: JSON Lines, a JSON list of rows, Arrow (as save_to_disk writes it) or Parquet,
    whose columns are checked before any row is read."""
    suffix = Path(name).suffix
    where = f"--suite {files.root}: {printable(name)}"
    if suffix in (".jsonl", ".json"):
        text = files.text(name, where)
        if suffix == ".jsonl":
            return [row for row, _ in _json_lines(text, where, "line", 1)]
        try:
            rows = parse_json(text)
        except NotJSON as exc:
            raise KVRuntimeError(f"{where} {exc}") from None
        if not isinstance(rows, list):
            raise KVRuntimeError(f"{where}: not a JSON list of rows (give one object per row)")
        return rows
    import pyarrow as pa

    data = pa.BufferReader(files.read(name))
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table_file = pq.ParquetFile(data)
            _check_columns(table_file.schema_arrow, where)
            table = table_file.read()
        else:
            reader = pa.ipc.open_stream(data)
            _check_columns(reader.schema, where)
            table = reader.read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:  # a damaged table; _check_columns' refusals pass
        raise KVRuntimeError(f"{where}: not a readable {suffix[1:]} table ({type(exc).__name__})") from None
    return table.to_pylist()


def _check_columns(schema: object, where: str) -> None:
    """Refuse a table whose columns are not the suite's fields, or not of their types (text; `answers` a list of
    text; `id` text or whole numbers): what a row would be refused for, said before any row is read."""
    import pyarrow as pa

    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_null)
    for field in schema:
        if field.name not in FIELDS:
            known = ", ".join(FIELDS)
            raise KVRuntimeError(f"{where}: unknown column {short_repr(printable(field.name))} (known: {known})")
        kind = field.type
        if field.name == "answers":
            fits = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and any(
                test(kind.value_type) for test in text
            )
        else:
            fits = any(test(kind) for test in text) or (field.name == "id" and pa.types.is_integer(kind))
        if not fits:
            raise KVRuntimeError(f"{where}: column {field.name!r} is of type {printable(kind)}, not the suite's")


def suite_prompt(row: SuiteRow, tokenizer: PreTrainedTokenizerBase, chat: bool, name: str, scoring: str) -> TaskPrompt:
    """The row as a prompt of the suite `name`: its context, then its question through the chat template (or raw,
    with an answer cue), then its answer prefix; its length is its context's tokens rounded up to a power of two (the
    report's length buckets), its fact's depth unknown."""
    from kvcompile.tasks.needles import render_prompt
    from kvcompile.tasks.retrieval import TaskPrompt

    prompt = render_prompt(tokenizer, f"{row.context}\n\n{row.question}", chat) + row.answer_prefix
    # The context ends where the question's text begins (the template may put its own words before the context).
    start = prompt.rindex(row.question)
    tokens = len(tokenizer(row.context, add_special_tokens=False).input_ids)
    return TaskPrompt(name, prompt, row.answers, length_bucket(tokens), None, start, scoring, row.id)


def length_bucket(tokens: int) -> int:
    """The smallest power of two of at least `tokens` (and at least 256): a report row per bucket, not per prompt."""
    return max(256, 1 << max(tokens - 1, 0).bit_length())
