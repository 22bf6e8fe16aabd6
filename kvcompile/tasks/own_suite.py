"""A user's own suite (`kvcompile eval --suite`, `kvcompile tune --suite`): prompts read from a JSON Lines file (one
object a line: `context`, `question`, `answers`, optional `answer_prefix` and `id`) or a folder of the same rows
(saved by `datasets`' `save_to_disk`, or .jsonl/.json/.parquet files). Every row is checked before torch loads and
a bad one refused in one line that names it; the file's text is never printed (it may be hostile)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvruntime import KVRuntimeError
from kvruntime.errors import short_repr

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvcompile.tasks.retrieval import TaskPrompt

FIELDS = ("context", "question", "answers", "answer_prefix", "id")
_TABLE_FILES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class SuiteRow:
    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    answer_prefix: str = ""
    where: str = ""  # 'suite.jsonl line 3': how a refusal names it


def read_suite(path: Path) -> list[SuiteRow]:
    """The rows of a suite file or folder, each checked (`suite_row`); refuses an empty suite and repeated ids."""
    rows = [suite_row(raw, where) for raw, where in _raw_rows(path)]
    if not rows:
        raise KVRuntimeError(f"--suite {path}: no prompt in it")
    seen: dict[str, str] = {}
    for row in rows:
        if row.id in seen:
            raise KVRuntimeError(f"{row.where}: id {short_repr(row.id)} is also {seen[row.id]}'s: give each its own")
        seen[row.id] = row.where
    return rows


def suite_digest(path: Path) -> str:
    """sha256 of the suite's bytes (a folder: of its files' names and bytes, in order): a resumed run must read the
    same prompts."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(file.relative_to(path.parent if path.is_file() else path).as_posix().encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()


def suite_row(raw: object, where: str) -> SuiteRow:
    """One row checked: a non-empty `context` and `question`, `answers` a non-empty list of non-empty strings,
    `answer_prefix` a string, `id` a string or a whole number (the row's place when absent)."""
    if not isinstance(raw, Mapping):
        raise KVRuntimeError(f"{where}: not an object with the fields {', '.join(FIELDS[:3])}")
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

    return SuiteRow(row_id, raw["context"], raw["question"], tuple(answers), prefix, where)


def _raw_rows(path: Path) -> Iterator[tuple[object, str]]:
    """(row, where) of every row: a JSON Lines file line by line (blank lines skipped), a folder through
    `datasets`."""
    if not path.exists():
        raise KVRuntimeError(f"--suite {path}: no such file or folder")
    if path.is_dir():
        yield from _dataset_rows(path)
        return
    if path.suffix != ".jsonl":
        raise KVRuntimeError(f"--suite {path}: give a .jsonl file or a folder saved by datasets")
    with open(path, encoding="utf-8", errors="strict") as handle:
        try:
            lines = list(enumerate(handle, start=1))
        except UnicodeDecodeError as exc:
            raise KVRuntimeError(f"--suite {path}: not UTF-8 text (byte {exc.start})") from None
    for number, line in lines:
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            yield json.loads(line), where
        except json.JSONDecodeError as exc:
            raise KVRuntimeError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None


def _dataset_rows(folder: Path) -> Iterator[tuple[object, str]]:
    """The rows of a folder saved by `datasets` (`save_to_disk`: one split, or a dict of splits of which `test` or
    the only one is read) or of .jsonl/.json/.parquet files, loaded from the local disk only."""
    import datasets

    if (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file():
        table = datasets.load_from_disk(str(folder))
        if isinstance(table, datasets.DatasetDict):
            split = "test" if "test" in table else next(iter(table)) if len(table) == 1 else None
            if split is None:
                raise KVRuntimeError(f"--suite {folder}: splits {sorted(table)} and none is 'test': save one split")
            table = table[split]
    else:
        files = sorted(p for p in folder.iterdir() if p.suffix in _TABLE_FILES)
        if not files:
            raise KVRuntimeError(f"--suite {folder}: no dataset saved by datasets, no .jsonl, .json or .parquet file")
        kind = "parquet" if files[0].suffix == ".parquet" else "json"
        if any((p.suffix == ".parquet") != (kind == "parquet") for p in files):
            raise KVRuntimeError(f"--suite {folder}: mixes parquet and json files: keep one format")
        try:
            table = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train")
        except Exception as exc:  # datasets' own errors: a file it cannot read as a table
            raise KVRuntimeError(
                f"--suite {folder}: datasets cannot read it as a table ({type(exc).__name__})"
            ) from None
    for index, row in enumerate(table, start=1):
        yield row, f"{folder.name} row {index}"


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
