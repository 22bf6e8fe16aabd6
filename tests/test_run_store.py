"""An evaluation run's records (run.json, runs.jsonl) that cannot be read are refused on --resume in one line naming
the file and what to do, and the folder is left as it was: a damaged record never ends in a traceback, and never
costs the records that are still good."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_refusals_before_torch import run_blocked

from kvcompile.evaluation.store import RunStore
from kvruntime import KVRuntimeError

SETTINGS = {"methods": ["full", "snapkv"], "ratios": [0.5]}
RECORD = {"prompt": 0, "method": "snapkv", "ratio": 0.5, "correct": 1}
GOOD_RUN = (json.dumps(SETTINGS) + "\n").encode()
GOOD_RECORDS = (json.dumps(RECORD) + "\n").encode()
DEEP = b"[" * 100_000 + b"]" * 100_000  # RecursionError in the parser
LONG_NUMBER = b"1" * 100_000  # ValueError: past Python's limit on digits converted to an int

# name -> (the file's bytes, a part of the one line)
BAD_RUN_JSON = {
    "not JSON": (b"{oops", "is not JSON (Expecting property name"),
    "empty": (b"", "is not JSON (Expecting value at line 1 column 1)"),
    "not UTF-8": (b'{"seed": "\xff\xfe"}', "it is not UTF-8 text"),
    "a list, not an object": (b"[1, 2]", "it holds a JSON list, not the run's settings"),
    "nested 100,000 deep": (DEEP, "is nested too deep to read"),
    "a 100,000-digit number": (b'{"seed": ' + LONG_NUMBER + b"}", "holds a number too long to read"),
}
BAD_RUNS_JSONL = {
    "not JSON": (GOOD_RECORDS + b"{oops\n", "line 2 is not JSON (Expecting property name"),
    "not UTF-8": (GOOD_RECORDS + b'{"answer": "\xff"}\n', "it is not UTF-8 text"),
    "a list, not a record": (b"[1, 2]\n", "line 1 is not a run record (a JSON object)"),
    "a record without its method": (b'{"prompt": 0, "ratio": 0.5}\n', "line 1 is not a run record (its method"),
    "a ratio that is not a number": (
        b'{"prompt": 0, "method": "full", "ratio": "half"}\n',
        "line 1 is not a run record (its ratio is missing or not a number)",
    ),
    "nested 100,000 deep": (GOOD_RECORDS + DEEP + b"\n", "line 2 is nested too deep to read"),
    "a 100,000-digit number": (b'{"prompt": ' + LONG_NUMBER + b"}\n", "line 1 holds a number too long to read"),
}


def _folder(tmp_path: Path, run_json: bytes, runs_jsonl: bytes) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_bytes(run_json)
    (folder / "runs.jsonl").write_bytes(runs_jsonl)
    return folder


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def _assert_refused(folder: Path, name: str, message: str) -> None:
    before = _snapshot(folder)
    with pytest.raises(KVRuntimeError) as refused:
        RunStore(folder, SETTINGS, resume=True, extendable=("methods",))
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"cannot resume from {folder / name}: ")
    assert message in line
    assert line.endswith("run again without --resume into a new --out")
    assert _snapshot(folder) == before  # nothing removed, rewritten or added


@pytest.mark.parametrize("case", BAD_RUN_JSON)
def test_a_damaged_run_json_is_refused_in_one_line(tmp_path, case):
    content, message = BAD_RUN_JSON[case]
    _assert_refused(_folder(tmp_path, content, GOOD_RECORDS), "run.json", message)


@pytest.mark.parametrize("case", BAD_RUNS_JSONL)
def test_a_damaged_runs_jsonl_is_refused_in_one_line(tmp_path, case):
    content, message = BAD_RUNS_JSONL[case]
    _assert_refused(_folder(tmp_path, GOOD_RUN, content), "runs.jsonl", message)


def test_good_records_still_resume(tmp_path):
    # A blank line is skipped; a line separator that is not "\n" (U+2028, written unescaped by another writer) is
    # part of its record, not a break between two.
    records = GOOD_RECORDS + b"\n" + '{"prompt": 1, "method": "full", "ratio": 0, "answer": "a\u2028b"}\n'.encode()
    store = RunStore(_folder(tmp_path, GOOD_RUN, records), SETTINGS, resume=True, extendable=("methods",))
    assert store.done(0, "snapkv", 0.5) and store.done(1, "full", 0.0)
    assert store.records[1]["answer"] == "a\u2028b"


def test_a_saved_setting_that_is_not_a_list_of_names_differs(tmp_path):
    saved = json.dumps({**SETTINGS, "methods": [["full"]]}).encode()
    with pytest.raises(KVRuntimeError, match=r"other settings \(methods differ\): use another --out"):
        RunStore(_folder(tmp_path, saved, GOOD_RECORDS), SETTINGS, resume=True, extendable=("methods",))


def test_eval_resume_refuses_a_damaged_run_json_before_torch_loads(tmp_path):
    folder = _folder(tmp_path, b"{oops", GOOD_RECORDS)
    before = _snapshot(folder)
    args = ["eval", "--resume", "--out", "run", "--tasks", "passkey", "--samples", "1", "--methods", "full,snapkv"]
    result = run_blocked(args, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: cannot resume from run/run.json: is not JSON (Expecting property name enclosed in double quotes at "
        "line 1 column 2); run again without --resume into a new --out"
    ]
    assert _snapshot(folder) == before
