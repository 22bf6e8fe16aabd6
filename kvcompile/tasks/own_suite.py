"""A user's own suite (`kvcompile eval --suite`, `kvcompile tune --suite`): prompts read from a JSON Lines file (one
object a line: `context`, `question`, `answers`, optional `answer_prefix` and `id`) or a folder of the same rows
(saved by `datasets`' `save_to_disk`, or .jsonl/.json/.parquet files). Every row is checked before torch loads and
a bad one refused in one line that names it; the file's text is never printed (it may be hostile).

A folder is read as a folder of the user's files, not through `datasets` (which follows its metadata wherever it
points and keeps a copy of the rows in its own cache): every file its metadata names is a plain file directly in it
(no `..`, absolute path or link out), special files are refused before they are opened, JSON goes through the run
store's bounded reader (`parse_unique`: a key named twice refused), Arrow and Parquet tables have their columns
checked before their rows are read, and the suite's digest covers exactly the bytes read.

What a suite holds is bounded before it is held (an outside probe made 17 KB of Parquet 2 GB of rows): its rows, its
bytes with each table counted decompressed (from the table's metadata, before it is read), a JSON text's bytes (a line,
a .json file, metadata: parsed whole) and a row's characters; a data file named twice is refused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvcompile.json_text import NotJSON, parse_json
from kvruntime import KVRuntimeError
from kvruntime.artifacts.artifact_header import RepeatedKeyError, unique_keys
from kvruntime.artifacts.bundle import is_plain_name
from kvruntime.errors import printable, short_repr

if TYPE_CHECKING:
    import pyarrow as pa
    from transformers import PreTrainedTokenizerBase

    from kvcompile.tasks.retrieval import TaskPrompt

FIELDS = ("context", "question", "answers", "answer_prefix", "id")
_TABLE_FILES = (".jsonl", ".json", ".parquet")
# What `save_to_disk` writes: a dataset's folder holds state.json (its Arrow files) beside dataset_info.json; a
# DatasetDict's folder holds dataset_dict.json (its splits, each a dataset's folder inside it).
_DATASET_STATE, _DATASET_DICT = "state.json", "dataset_dict.json"
MAX_SUITE_ROWS = 100_000
MAX_SUITE_BYTES = 256 << 20  # its files' bytes, a table's decompressed: what its rows take, within a few times
MAX_ROW_CHARS = 4 << 20  # a row's text: about a million tokens, past what most models hold
# One JSON text, parsed whole (a line, a .json file, metadata): parsing can take 20 times its bytes (a list of empty
# lists), so it is bounded on its own; a row at MAX_ROW_CHARS fits in it four times over.
MAX_JSON_BYTES = 16 << 20
# No tokenizer puts more characters than this in a token on average: a longer row cannot fit the model's positions,
# refused before it is tokenized (tokenizing 10 MB took 29 s and 2 GB).
CHARS_PER_POSITION = 16
# A line of JSON Lines holding something other than whitespace (bytes, without the newline).
_LINE = re.compile(rb"^[^\S\n]*\S[^\n]*", re.MULTILINE)


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
    texts = {"context": [raw["context"]], "question": [raw["question"]], "answers": answers, "answer_prefix": [prefix]}
    _check_text({**texts, "id": [row_id]}, where)
    return SuiteRow(row_id, raw["context"], raw["question"], answers, prefix, where)


def _check_text(texts: Mapping[str, Sequence[str]], where: str) -> None:
    """Refuse a row of more than MAX_ROW_CHARS characters, or with a lone surrogate (JSON's "\\ud800", which no
    tokenizer encodes: it failed in the tokenizer once the model had loaded), naming the row and the field."""
    chars = sum(len(text) for values in texts.values() for text in values)
    if chars > MAX_ROW_CHARS:
        raise KVRuntimeError(f"{where}: {chars:,} characters, more than the {MAX_ROW_CHARS:,} a row may hold")
    for field, values in texts.items():
        for text in values:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                lone = printable(text[exc.start])
                raise KVRuntimeError(f"{where}: {field!r} holds a lone surrogate ({lone}): not text") from None


class _SuiteFiles:
    """The suite's files, read whole, once each: a plain file (not a FIFO, a device, a folder or a link) inside the
    suite, its name and bytes added to the digest in the order read; what they hold counted against the suite's
    bounds (`take`) before it is held."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.digest = hashlib.sha256()
        self.sizes: dict[str, int] = {}  # each file's bytes, or its table's decompressed when more (`take`)
        self.rows = 0
        try:
            mode = os.stat(root).st_mode  # the path the user typed may be a link of theirs; what it holds may not
        except OSError:
            raise KVRuntimeError(f"--suite {root}: no such file or folder") from None
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise KVRuntimeError(f"--suite {root}: not a file or a folder (a FIFO or a device is not read)")

    def take(self, name: str, size: int = 0, rows: int = 0) -> None:
        """Count `rows` more rows, and `size` bytes for the file `name` (a file counts at the most it was given:
        its bytes, its table encoded, decompressed); refuse the suite past MAX_SUITE_ROWS or MAX_SUITE_BYTES, before
        what was counted is read."""
        self.rows += rows
        if self.rows > MAX_SUITE_ROWS:
            limit = f"{MAX_SUITE_ROWS:,} rows"
            raise KVRuntimeError(f"--suite {self.root}: {printable(name)}: more than the {limit} a suite may hold")
        self.sizes[name] = max(self.sizes.get(name, 0), size)
        if sum(self.sizes.values()) > MAX_SUITE_BYTES:
            limit = f"{MAX_SUITE_BYTES >> 20} MiB"
            raise KVRuntimeError(
                f"--suite {self.root}: {printable(name)}: more than the {limit} a suite may hold (its tables "
                "decompressed): split it"
            )

    def read(self, relative: str = "", json_text: bool = False) -> bytes:
        """The bytes of the file `relative` (names separated by '/', each checked by the caller), or of the suite
        itself when it is a file; its size counted (`take`) before it is read, and held to MAX_JSON_BYTES when it
        is one JSON text (`json_text`: parsed whole)."""
        path = self.root.joinpath(*relative.split("/")) if relative else self.root
        name = relative or path.name
        flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if relative else 0)  # a FIFO put in its place never blocks
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            problem = "a symbolic link" if os.path.islink(path) else exc.strerror or "unreadable"
            raise KVRuntimeError(f"--suite {self.root}: {printable(name)}: {problem}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # checked on the descriptor: os.fdopen would fail on a folder's
            os.close(fd)
            kind = "a folder, not a file of rows" if stat.S_ISDIR(info.st_mode) else "not a plain file"
            raise KVRuntimeError(f"--suite {self.root}: {printable(name)} is {kind}")
        with os.fdopen(fd, "rb") as handle:
            self._fits(name, info.st_size, json_text)
            room = MAX_JSON_BYTES if json_text else MAX_SUITE_BYTES - sum(self.sizes.values()) + self.sizes[name]
            data = handle.read(room + 1)  # a file grown since it was measured is refused by its length
        self._fits(name, len(data), json_text)
        encoded = name.encode("utf-8", "surrogateescape")
        self.digest.update(len(encoded).to_bytes(8, "big") + encoded + len(data).to_bytes(8, "big") + data)
        return data

    def _fits(self, name: str, size: int, json_text: bool) -> None:
        if json_text and size > MAX_JSON_BYTES:
            raise KVRuntimeError(
                f"--suite {self.root}: {printable(name)}: {size:,} bytes, more than the {MAX_JSON_BYTES >> 20} MiB "
                "a JSON file is read whole (give a long suite as JSON Lines)"
            )
        self.take(name, size)

    def listing(self, relative: str = "") -> list[str]:
        """The names in the folder `relative`, which must be a folder inside the suite, not a link to one."""
        path = self.root.joinpath(*relative.split("/")) if relative else self.root
        if relative and (path.is_symlink() or not path.is_dir()):
            raise KVRuntimeError(f"--suite {self.root}: {printable(relative)} is not a folder of the suite")
        return sorted(os.listdir(path))

    def json(self, relative: str) -> object:
        """The JSON text of the file `relative`, parsed (`parse_unique`)."""
        where = f"--suite {self.root}: {relative}"
        try:
            return parse_unique(_utf8(self.read(relative, json_text=True), where))
        except NotJSON as exc:
            raise KVRuntimeError(f"{where} {exc}") from None


def parse_unique(text: str, one_line: bool = False) -> object:
    """`parse_json`'s, refusing an object that names a key twice: a row's second 'answers' would win unseen."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except RepeatedKeyError as exc:
        raise NotJSON(f"names {short_repr(printable(exc.key))} twice in one object") from None
    except (ValueError, RecursionError):
        pass  # parse_json fails on it the same way, and says why in its words
    return parse_json(text, one_line)


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVRuntimeError(f"{where}: not UTF-8 text (byte {exc.start})") from None


def _raw_rows(path: Path, files: _SuiteFiles) -> Iterator[tuple[object, str]]:
    """(row, where) of every row: a JSON Lines file line by line (blank lines skipped), a folder's tables."""
    if path.is_dir():
        yield from _folder_rows(path, files)
        return
    if path.suffix != ".jsonl":
        raise KVRuntimeError(f"--suite {path}: give a .jsonl file or a folder saved by datasets")
    yield from _json_lines(files, "", path.name)


def _json_lines(files: _SuiteFiles, relative: str, name: str) -> Iterator[tuple[object, str]]:
    """The rows of the JSON Lines file `relative`, each named '`name` line N' (N counting every line): each line
    counted as a row and held to MAX_JSON_BYTES before it is decoded and parsed."""
    data = files.read(relative)
    number, at = 1, 0
    for line in _LINE.finditer(data):  # on newlines only: a JSON text escapes every other line break
        number += data.count(b"\n", at, line.start())
        at = line.start()
        where = f"{name} line {number}"
        files.take(relative or name, rows=1)
        if line.end() - line.start() > MAX_JSON_BYTES:
            length = f"{line.end() - line.start():,} bytes"
            raise KVRuntimeError(f"{where}: {length}, more than the {MAX_JSON_BYTES >> 20} MiB a line may be")
        try:
            row = parse_unique(_utf8(line.group(), where), one_line=True)
        except NotJSON as exc:
            raise KVRuntimeError(f"{where}: {str(exc).removeprefix('is ')}") from None
        yield row, where


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
    """The Arrow files a saved dataset's state.json names, each a plain file of its folder, named once."""
    state_path = f"{split}/{_DATASET_STATE}" if split else _DATASET_STATE
    if _DATASET_STATE not in names:
        raise KVRuntimeError(f"--suite {files.root}: no {state_path} (save the split with datasets' save_to_disk)")
    state = files.json(state_path)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise KVRuntimeError(f"--suite {files.root}: {state_path} names no data files")
    tables = [entry.get("filename") for entry in entries]
    seen: set[str] = set()
    for name in tables:
        if not is_plain_name(name) or Path(name).suffix != ".arrow":
            raise KVRuntimeError(
                f"--suite {files.root}: {state_path} names {short_repr(name)}: a suite's data files are .arrow "
                "files inside its folder"
            )
        if name in seen:  # its rows read twice (one 10 MB file named 100 times made 1.1 GB of rows)
            raise KVRuntimeError(f"--suite {files.root}: {state_path} names {short_repr(name)} twice")
        seen.add(name)
    return [f"{split}/{name}" if split else name for name in tables]


def _table_rows(files: _SuiteFiles, name: str) -> Iterator[object]:
    """The rows of one table file: JSON Lines, a JSON list of rows, Arrow (as save_to_disk writes it) or Parquet,
    whose columns are checked, and rows and sizes counted, before any row is read."""
    suffix = Path(name).suffix
    where = f"--suite {files.root}: {printable(name)}"
    if suffix == ".jsonl":
        yield from (row for row, _ in _json_lines(files, name, where))
        return
    if suffix == ".json":
        try:
            rows = parse_unique(_utf8(files.read(name, json_text=True), where))
        except NotJSON as exc:
            raise KVRuntimeError(f"{where} {exc}") from None
        if not isinstance(rows, list):
            raise KVRuntimeError(f"{where}: not a JSON list of rows (give one object per row)")
        files.take(name, rows=len(rows))
        yield from rows
        return
    import pyarrow as pa

    data = files.read(name)
    try:
        tables = (_parquet_tables if suffix == ".parquet" else _arrow_tables)(files, name, data, where)
        for table in tables:
            table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:  # a damaged table; the refusals above pass
        raise KVRuntimeError(f"{where}: not a readable {suffix[1:]} table ({type(exc).__name__})") from None
    for table in tables:
        yield from table.to_pylist()


def _arrow_tables(files: _SuiteFiles, name: str, data: bytes, where: str) -> list[pa.Table]:
    """An Arrow stream (as save_to_disk writes it): its columns checked, then each record batch's rows and size
    once decompressed counted from its metadata (`_batch_sizes`), then read."""
    import pyarrow as pa

    messages = iter(pa.ipc.MessageReader.open_stream(pa.py_buffer(data)))
    first = next(messages, None)
    if first is None or first.type != "schema":
        raise ValueError("no schema")
    _check_columns(pa.ipc.read_schema(first), where)
    size = 0
    for message in messages:
        if message.type != "record batch":  # a dictionary batch: no column of a suite is dictionary-encoded
            raise ValueError(message.type)
        rows, decompressed = _batch_sizes(memoryview(message.metadata), memoryview(message.body))
        size += decompressed
        files.take(name, size, rows=max(rows, 1))  # an empty batch costs what a row does
    return [pa.ipc.open_stream(data).read_all()]


def _batch_sizes(metadata: memoryview, body: memoryview) -> tuple[int, int]:
    """(rows, bytes once decompressed) of an Arrow record batch message, from its flatbuffer metadata (Message.fbs:
    a Message whose field 2 is a RecordBatch of length, nodes, buffers and compression) and the first 8 bytes of each
    compressed buffer (its length decompressed, -1 when stored as is): nothing decompressed. ValueError when they do
    not add up."""
    message = _unpack(metadata, 0, "<I")[0]  # the root table
    batch = _flatbuffer_target(metadata, _flatbuffer_field(metadata, message, 2))
    length = _flatbuffer_field(metadata, batch, 0)
    rows = _unpack(metadata, length, "<q")[0] if length else 0
    buffers = _flatbuffer_target(metadata, _flatbuffer_field(metadata, batch, 2))  # its count, then (offset, length)
    compressed = _flatbuffer_field(metadata, batch, 3) != 0
    count = _unpack(metadata, buffers, "<I")[0]
    if buffers + 4 + 16 * count > len(metadata):
        raise ValueError("more buffers than the metadata holds")
    size = 0
    for index in range(count):
        offset, stored = _unpack(metadata, buffers + 4 + 16 * index, "<qq")
        if offset < 0 or stored < 0 or offset + stored > len(body):
            raise ValueError("a buffer outside the body")
        if not (compressed and stored):
            size += stored
            continue
        decompressed = _unpack(body, offset, "<q")[0]
        if decompressed < -1:
            raise ValueError("a negative length")
        size += stored - 8 if decompressed == -1 else decompressed
    return rows, size


def _flatbuffer_field(data: memoryview, table: int, index: int) -> int:
    """Where field `index` of the flatbuffer table at `table` is (0: absent, its default)."""
    vtable = table - _unpack(data, table, "<i")[0]
    if 4 + 2 * index >= _unpack(data, vtable, "<H")[0]:
        return 0
    offset = _unpack(data, vtable + 4 + 2 * index, "<H")[0]
    return table + offset if offset else 0


def _flatbuffer_target(data: memoryview, at: int) -> int:
    """What the offset stored at `at` (a field's place) points to, a table or a vector; ValueError when absent."""
    if not at:
        raise ValueError("a field missing")
    return at + _unpack(data, at, "<I")[0]


def _unpack(data: memoryview, at: int, layout: str) -> tuple[int, ...]:
    """`struct.unpack_from`, with ValueError for what lies outside `data` (an offset of a damaged file)."""
    if at < 0 or at + struct.calcsize(layout) > len(data):
        raise ValueError("an offset outside its buffer")
    return struct.unpack_from(layout, data, at)


def _parquet_tables(files: _SuiteFiles, name: str, data: bytes, where: str) -> list[pa.Table]:
    """A Parquet file's row groups: its columns checked, its rows and pages' size decompressed counted from its
    footer, then each group read with its text kept dictionary-encoded (a value repeated in every row held once)
    and counted as the rows will hold it, before any row is made."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    footer = pq.ParquetFile(pa.BufferReader(data))
    _check_columns(footer.schema_arrow, where)
    meta = footer.metadata
    groups = [meta.row_group(index) for index in range(meta.num_row_groups)]
    files.take(name, rows=sum(max(group.num_rows, 1) for group in groups))  # an empty group costs what a row does
    columns = [group.column(index) for group in groups for index in range(group.num_columns)]
    files.take(name, sum(max(column.total_uncompressed_size, 0) for column in columns))
    leaves = [footer.schema.column(index).path for index in range(len(footer.schema))]  # its text ones are encoded
    reader = pq.ParquetFile(pa.BufferReader(data), metadata=meta, read_dictionary=leaves)
    tables, size = [], 0
    for index in range(len(groups)):  # one at a time: pyarrow reads a list of dictionary text as one chunk only
        tables.append(reader.read_row_group(index))
        size += sum(_expanded_bytes(chunk) for column in tables[-1].columns for chunk in column.chunks)
        files.take(name, size)
    return tables


def _expanded_bytes(array: pa.Array) -> int:
    """The bytes `array` holds once its dictionaries are expanded (each index taken as its value's length)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(array.type):
        return pc.sum(pc.take(pc.binary_length(array.dictionary), array.indices)).as_py() or 0
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        return array.offsets.nbytes + _expanded_bytes(array.flatten())
    return array.nbytes


def _check_columns(schema: pa.Schema, where: str) -> None:
    """Refuse a table whose columns are not the suite's fields, each once (a repeated one would win silently), or
    not of their types (text; `answers` a list of text; `id` text or whole numbers): what a row would be refused
    for, said before any row is read."""
    import pyarrow as pa

    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_null)
    seen: set[str] = set()
    for field in schema:
        if field.name not in FIELDS:
            known = ", ".join(FIELDS)
            raise KVRuntimeError(f"{where}: unknown column {short_repr(printable(field.name))} (known: {known})")
        if field.name in seen:
            raise KVRuntimeError(f"{where}: column {field.name!r} appears twice")
        seen.add(field.name)
        kind = field.type
        if field.name == "answers":
            fits = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and any(
                test(kind.value_type) for test in text
            )
        else:
            fits = any(test(kind) for test in text) or (field.name == "id" and pa.types.is_integer(kind))
        if not fits:
            raise KVRuntimeError(f"{where}: column {field.name!r} is of type {printable(kind)}, not the suite's")


def suite_prompt(
    row: SuiteRow,
    tokenizer: PreTrainedTokenizerBase,
    chat: bool,
    name: str,
    scoring: str,
    positions: int | None = None,
) -> TaskPrompt:
    """The row as a prompt of the suite `name`: its context, then its question through the chat template (or raw,
    with an answer cue), then its answer prefix; its length is its context's tokens rounded up to a power of two (the
    report's length buckets), its fact's depth unknown. A row the model's `positions` cannot hold by its characters
    alone (`check_row_fits`) is refused before it is tokenized."""
    from kvcompile.tasks.needles import render_prompt
    from kvcompile.tasks.retrieval import TaskPrompt

    check_row_fits(row, positions)
    prompt = render_prompt(tokenizer, f"{row.context}\n\n{row.question}", chat) + row.answer_prefix
    # The context ends where the question's text begins (the template may put its own words before the context).
    start = prompt.rindex(row.question)
    tokens = len(tokenizer(row.context, add_special_tokens=False).input_ids)
    return TaskPrompt(name, prompt, row.answers, length_bucket(tokens), None, start, scoring, row.id)


def check_row_fits(row: SuiteRow, positions: int | None) -> None:
    """Refuse a row of more than CHARS_PER_POSITION characters per position of the model (`positions`; None: not
    known, nothing refused): it cannot fit, and tokenizing it to find out could take minutes."""
    chars = len(row.context) + len(row.question) + len(row.answer_prefix)
    if positions is not None and chars > positions * CHARS_PER_POSITION:
        raise KVRuntimeError(
            f"{row.where}: {chars:,} characters, more than the model's {positions:,} positions can hold (at most "
            f"{CHARS_PER_POSITION} characters a position)"
        )


def length_bucket(tokens: int) -> int:
    """The smallest power of two of at least `tokens` (and at least 256): a report row per bucket, not per prompt."""
    return max(256, 1 << max(tokens - 1, 0).bit_length())
