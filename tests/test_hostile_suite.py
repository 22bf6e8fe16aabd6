"""A hostile suite (issue #73, an outside probe) refused in one line before torch, and before what it would cost is
held: its decompressed bytes and rows bounded from the tables' metadata, a data file named twice, a JSON Lines file
or line past its bound, a row past its characters (or the model's positions), a lone surrogate, a repeated JSON key
or Arrow column, a data file that is a folder. The suite's ordinary refusals are test_own_suite.py's."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvcompile.tasks import own_suite
from kvcompile.tasks.own_suite import MAX_JSON_BYTES, MAX_ROW_CHARS, MAX_SUITE_BYTES, MAX_SUITE_ROWS, read_suite
from kvruntime import KVRuntimeError

ROW = {"context": "Ada lives in Lyon.", "question": "Where does Ada live?", "answers": ["Lyon"]}
SCHEMA = pa.schema([("context", pa.string()), ("question", pa.string()), ("answers", pa.list_(pa.string()))])


def _refusal(path: Path) -> tuple[str, float, float]:
    """read_suite(path)'s refusal in a fresh process: its message, its seconds and its process's peak memory past
    what it held before it read, in MiB (pyarrow imported before, as the reader would import it; the peak reset
    through /proc/self/clear_refs: a child starts with its parent's)."""
    script = (
        "import re, sys, time\n"
        "from pathlib import Path\n"
        "import pyarrow, pyarrow.compute, pyarrow.parquet\n"
        "from kvcompile.tasks.own_suite import read_suite\n"
        "from kvruntime import KVRuntimeError\n"
        "def kib(name):\n"
        "    return int(re.search(name + r':\\s+(\\d+)', Path('/proc/self/status').read_text()).group(1))\n"
        "Path('/proc/self/clear_refs').write_text('5')\n"
        "before = kib('VmRSS')\n"
        "start = time.perf_counter()\n"
        "try:\n"
        "    read_suite(Path(sys.argv[1]))\n"
        "    message = 'read'\n"
        "except KVRuntimeError as exc:\n"
        "    message = str(exc)\n"
        "seconds = time.perf_counter() - start\n"
        "print(repr((message, seconds, (kib('VmHWM') - before) / 1024)))\n"
    )
    ran = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return ast.literal_eval(ran.stdout.strip().splitlines()[-1])


def _assert_refused_cheaply(path: Path, message: str) -> None:
    said, seconds, grown_mib = _refusal(path)
    assert re.search(message, said) and "\n" not in said, said
    assert grown_mib < 100, (seconds, grown_mib)  # unbounded, each took 1 GB or more (time: refusal_latency.md)


def _saved_arrow(folder: Path, batches: list[pa.RecordBatch], compression: str | None = None) -> Path:
    """A folder as save_to_disk writes it: state.json naming one Arrow stream of `batches`."""
    folder.mkdir()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.OSFile(str(folder / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA, options=options) as out:
        for batch in batches:
            out.write_batch(batch)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    return folder


def test_a_compressed_arrow_file_past_the_suites_bytes_is_refused_from_its_metadata(tmp_path):
    # 16 rows of 1 MiB (rows a suite may hold), written 17 times zstd-compressed: about 50 KB on disk, 272 MiB read.
    context = pa.array(["x" * (1 << 20)] * 16)
    batch = pa.record_batch([context, pa.array(["q"] * 16), pa.array([["a"]] * 16)], schema=SCHEMA)
    folder = _saved_arrow(tmp_path / "bomb", [batch] * 17, "zstd")
    assert (folder / "data.arrow").stat().st_size < 1 << 20
    _assert_refused_cheaply(folder, rf"data\.arrow: more than the {MAX_SUITE_BYTES >> 20} MiB a suite may hold")


def test_a_parquet_file_past_the_suites_bytes_once_its_dictionary_is_expanded_is_refused(tmp_path):
    # One 16 KiB value in every one of 20,000 rows: dictionary-encoded, under 1 KB on disk; 320 MiB as rows.
    rows = 20_000
    repeated = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["x" * (16 << 10)]))
    question = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["q"]))
    table = pa.table({"context": repeated, "question": question, "answers": pa.array([["a"]] * rows)})
    (tmp_path / "bomb").mkdir()
    pq.write_table(table, str(tmp_path / "bomb" / "part.parquet"), store_schema=False, compression="zstd")
    assert (tmp_path / "bomb" / "part.parquet").stat().st_size < 1 << 20
    _assert_refused_cheaply(tmp_path / "bomb", rf"part\.parquet: more than the {MAX_SUITE_BYTES >> 20} MiB")


def test_a_table_past_the_suites_rows_is_refused_from_its_metadata(tmp_path):
    rows = MAX_SUITE_ROWS + 1
    (tmp_path / "many").mkdir()
    table = pa.table({"context": ["c"] * rows, "question": ["q"] * rows, "answers": [["a"]] * rows})
    pq.write_table(table, str(tmp_path / "many" / "part.parquet"))
    with pytest.raises(KVRuntimeError, match=f"part.parquet: more than the {MAX_SUITE_ROWS:,} rows a suite may hold"):
        read_suite(tmp_path / "many")
    batch = pa.record_batch([pa.array(["c"] * rows), pa.array(["q"] * rows), pa.array([["a"]] * rows)], schema=SCHEMA)
    with pytest.raises(KVRuntimeError, match=f"data.arrow: more than the {MAX_SUITE_ROWS:,} rows"):
        read_suite(_saved_arrow(tmp_path / "saved", [batch]))
    (tmp_path / "lines.jsonl").write_text((json.dumps(ROW) + "\n") * rows)
    with pytest.raises(KVRuntimeError, match=f"lines.jsonl: more than the {MAX_SUITE_ROWS:,} rows"):
        read_suite(tmp_path / "lines.jsonl")


def test_a_data_file_named_twice_in_state_json_is_refused(tmp_path):
    batch = pa.record_batch([pa.array([ROW["context"]]), pa.array([ROW["question"]]), pa.array([["Lyon"]])], SCHEMA)
    folder = _saved_arrow(tmp_path / "s", [batch])
    assert len(read_suite(folder).rows) == 1
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}] * 100}))
    with pytest.raises(KVRuntimeError, match="state.json names 'data.arrow' twice"):
        read_suite(folder)


def test_a_json_lines_file_past_the_suites_bytes_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as sparse:  # 2 GB on paper, nothing on disk: refused by its size alone
        sparse.truncate(2 << 30)
    _assert_refused_cheaply(path, rf"huge\.jsonl: more than the {MAX_SUITE_BYTES >> 20} MiB a suite may hold")


@pytest.mark.parametrize("name", ["long.jsonl", "folder/long.jsonl", "folder/long.json", "folder/state.json"])
def test_a_json_text_past_its_bound_is_refused_before_it_is_parsed(tmp_path, name):
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    text = json.dumps({**ROW, "context": "x" * MAX_JSON_BYTES})
    path.write_text(json.dumps(ROW) + "\n" + text + "\n" if name.endswith(".jsonl") else text)
    suite = path if name == "long.jsonl" else path.parent
    if name.endswith(".jsonl"):
        match = rf"long\.jsonl line 2: {len(text):,} bytes, more than the {MAX_JSON_BYTES >> 20} MiB a line may be"
    else:
        match = rf"{Path(name).name}: {len(text):,} bytes, more than the {MAX_JSON_BYTES >> 20} MiB a JSON file"
    _assert_refused_cheaply(suite, match)


def test_a_row_past_its_characters_is_refused_naming_it(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "context": "x" * MAX_ROW_CHARS}) + "\n")
    chars = MAX_ROW_CHARS + len(ROW["question"]) + len("Lyon") + len("line 2")  # its id: its line
    with pytest.raises(
        KVRuntimeError, match=f"^mine.jsonl line 2: {chars:,} characters, more than the {MAX_ROW_CHARS:,} "
    ):
        read_suite(path)


class _NoTokenizer:
    """A tokenizer that must not be called: a row too long for the model is refused before it is tokenized."""

    chat_template = None

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized")

    apply_chat_template = __call__


def test_a_row_longer_than_the_models_positions_can_hold_is_refused_before_it_is_tokenized(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({**ROW, "context": "x" * 100_000}) + "\n")
    (row,) = read_suite(path).rows
    chars = 100_000 + len(ROW["question"])  # what the prompt holds of the row: its context, question and prefix
    with pytest.raises(KVRuntimeError, match=f"^mine.jsonl line 1: {chars:,} characters, more than the model's 4,096"):
        own_suite.suite_prompt(row, _NoTokenizer(), False, "mine", "substring", positions=4096)
    own_suite.check_row_fits(row, 8192)  # 16 characters a position: room enough
    own_suite.check_row_fits(row, None)  # positions not known: nothing refused


@pytest.mark.parametrize(
    "row, field",
    [
        ('{"context": "a\\ud800b", "question": "q", "answers": ["a"]}', "context"),
        ('{"context": "c", "question": "q", "answers": ["a", "\\udfff"]}', "answers"),
        ('{"context": "c", "question": "q", "answers": ["a"], "id": "\\ud83d"}', "id"),
    ],
)
def test_a_lone_surrogate_is_refused_when_read_naming_its_row(tmp_path, row, field):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + row + "\n")
    with pytest.raises(KVRuntimeError, match=rf"^mine.jsonl line 2: '{field}' holds a lone surrogate \(\\u"):
        read_suite(path)


def test_a_repeated_json_key_is_refused(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"context": "c", "question": "q", "answers": ["a"], "answers": ["b"]}\n')
    with pytest.raises(KVRuntimeError, match="^mine.jsonl line 1: names 'answers' twice in one object$"):
        read_suite(path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "rows.json").write_text('[{"context": "c", "context": "d", "question": "q"}]')
    with pytest.raises(KVRuntimeError, match="rows.json names 'context' twice in one object"):
        read_suite(tmp_path / "folder")
    batch = pa.record_batch([pa.array(["c"]), pa.array(["q"]), pa.array([["a"]])], schema=SCHEMA)
    saved = _saved_arrow(tmp_path / "saved", [batch])
    (saved / "state.json").write_text('{"_data_files": [{"filename": "data.arrow"}], "_data_files": []}')
    with pytest.raises(KVRuntimeError, match="state.json names '_data_files' twice"):
        read_suite(saved)


def test_a_repeated_column_is_refused(tmp_path):
    names = ["context", "question", "answers", "context"]
    table = pa.table([pa.array(["c"]), pa.array(["q"]), pa.array([["a"]]), pa.array(["d"])], names=names)
    (tmp_path / "parquet").mkdir()
    pq.write_table(table, str(tmp_path / "parquet" / "part.parquet"))
    with pytest.raises(KVRuntimeError, match="part.parquet: column 'context' appears twice"):
        read_suite(tmp_path / "parquet")
    (tmp_path / "saved").mkdir()
    with pa.OSFile(str(tmp_path / "saved" / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    (tmp_path / "saved" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    with pytest.raises(KVRuntimeError, match="data.arrow: column 'context' appears twice"):
        read_suite(tmp_path / "saved")


def test_a_data_file_that_is_a_folder_is_refused_naming_it(tmp_path):
    (tmp_path / "files" / "rows.jsonl").mkdir(parents=True)
    with pytest.raises(KVRuntimeError, match="^--suite .*files: rows.jsonl is a folder, not a file of rows$"):
        read_suite(tmp_path / "files")
    (tmp_path / "saved" / "data.arrow").mkdir(parents=True)
    (tmp_path / "saved" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    with pytest.raises(KVRuntimeError, match="data.arrow is a folder, not a file of rows$"):
        read_suite(tmp_path / "saved")
    os.rmdir(tmp_path / "saved" / "data.arrow")
    (tmp_path / "saved" / "data.arrow").write_bytes(b"not arrow")
    with pytest.raises(KVRuntimeError, match="data.arrow: not a readable arrow table"):
        read_suite(tmp_path / "saved")


def test_a_suite_within_the_bounds_reads_its_rows_from_every_format(tmp_path):
    """The bounds count what the rows hold: a suite of compressed tables within them reads whole."""
    rows = 2_000
    columns = [pa.array([f"context {i} " * 50 for i in range(rows)]), pa.array(["q"] * rows), pa.array([["a"]] * rows)]
    batches = [pa.record_batch(columns, schema=SCHEMA).slice(start, 500) for start in range(0, rows, 500)]
    assert len(read_suite(_saved_arrow(tmp_path / "arrow", batches, "lz4")).rows) == rows
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.Table.from_batches(batches), str(tmp_path / "parquet" / "part.parquet"), row_group_size=700)
    suite = read_suite(tmp_path / "parquet").rows
    assert len(suite) == rows and suite[-1].context == f"context {rows - 1} " * 50
