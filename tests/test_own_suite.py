"""A user's own suite (`kvcompile eval --suite`, `tune --suite`): the rows read from JSON Lines and from datasets
folders with every refusal naming its row, and runs end to end on a tiny model, each score known (the default
model's run is in test_eval_default_model.py; the scorings' own tests are test_scoring.py's). The refusals before
torch are test_refusals_before_torch.py's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_char_tokenizer, tiny_model
from typer.testing import CliRunner

from kvcompile import recipe
from kvcompile.cli import app
from kvcompile.tasks.own_suite import FIELDS, length_bucket, read_suite, suite_prompt
from kvruntime import KVRuntimeError

ROWS = [
    {"id": "capital", "context": "Ada lives in Lyon. " * 6, "question": "Where does Ada live?", "answers": ["Lyon"]},
    {"context": "The code is 4417. " * 5, "question": "What is the code?", "answers": ["4417", "four four"]},
    {"context": "Bo has a red kite. " * 7, "question": "What does Bo have?", "answers": ["a red kite"],
     "answer_prefix": "Answer:"},
]  # fmt: skip


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_rows_are_read_from_json_lines_with_ids_and_answer_prefixes(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    rows = read_suite(path).rows
    assert [r.id for r in rows] == ["capital", "line 2", "line 3"]
    assert rows[1].answers == ("4417", "four four") and rows[2].answer_prefix == "Answer:"
    assert rows[0].where == "mine.jsonl line 1"
    assert read_suite(path).sha256 != read_suite(write_jsonl(tmp_path / "other.jsonl", ROWS[:2])).sha256


def test_answers_are_kept_stripped_so_that_a_scoring_can_match_them(tmp_path):
    row = {**ROWS[0], "answers": [" Lyon\n", "\tthe city of Lyon "]}
    assert read_suite(write_jsonl(tmp_path / "mine.jsonl", [row])).rows[0].answers == ("Lyon", "the city of Lyon")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "q", "answers": ["a"]}', "line 2: no 'context' (give a non-empty string)"),
        ('{"context": "c", "question": "  ", "answers": ["a"]}', "line 2: no 'question'"),
        ('{"context": "c", "question": "q", "answers": []}', "line 2: no 'answers'"),
        ('{"context": "c", "question": "q", "answers": "a"}', "line 2: 'answers' is a string"),
        ('{"context": "c", "question": "q", "answers": ["a", ""]}', "line 2: every one of 'answers'"),
        ('{"context": "c", "question": "q", "answers": ["a"], "id": true}', "line 2: 'id' must be"),
        ('{"context": "c", "question": "q", "answers": ["a"], "answer_prefix": 3}', "line 2: 'answer_prefix'"),
        ('{"context": "c", "question": "q", "answers": ["a"], "id": "capital"}', "line 2: id 'capital' is also"),
        ('["c", "q"]', "line 2: not an object"),
        ('{"context": "c",', "line 2: not JSON"),
        (
            '{"context": "c", "question": "q", "answers": ["a"], "answer_prefx": "A:"}',
            "line 2: unknown field 'answer_prefx' (known: context, question, answers, answer_prefix, id)",
        ),
        (
            '{"context": "c", "question": "q", "answers": ["a"], "id": ' + "7" * 5000 + "}",
            "line 2: holds a number too long to read",
        ),
        ('{"context": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 2: nested too deep to read"),
    ],
)
def test_a_bad_line_is_refused_in_one_line_naming_it(tmp_path, line, message):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(KVRuntimeError, match="^mine.jsonl " + message.replace("(", r"\(").replace(")", r"\)")):
        read_suite(path)


def test_a_hostile_line_is_named_never_printed(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"context": "\x1b[2J\x1b]0;owned\x07", "question": "q", "answers": "\x1b[31m"}) + "\n")
    with pytest.raises(KVRuntimeError) as refused:
        read_suite(path)
    assert "\x1b" not in str(refused.value) and "owned" not in str(refused.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "none.jsonl", "no such file or folder"),
        (lambda d: (d / "empty.jsonl").write_text("\n\n") and d / "empty.jsonl", "no prompt in it"),
        (lambda d: (d / "rows.csv").write_text("a,b\n") and d / "rows.csv", "give a .jsonl file or a folder"),
        (lambda d: (d / "bytes.jsonl").write_bytes(b"\xff\xfe{}") and d / "bytes.jsonl", "not UTF-8 text"),
    ],
)
def test_a_suite_that_is_not_one_is_refused(tmp_path, make, message):
    with pytest.raises(KVRuntimeError, match=message):
        read_suite(make(tmp_path))


def test_a_datasets_folder_reads_the_same_rows_as_the_json_lines(tmp_path):
    import datasets

    expected = read_suite(write_jsonl(tmp_path / "mine.jsonl", ROWS)).rows
    columns = {key: [row.get(key) for row in ROWS] for key in ("id", "context", "question", "answers")}
    columns["answer_prefix"] = [row.get("answer_prefix", "") for row in ROWS]
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(columns)}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "files").mkdir()
    datasets.Dataset.from_dict(columns).to_parquet(str(tmp_path / "files" / "part.parquet"))

    def content(rows):  # what the runs read; ids the file leaves out are the rows' places, named per source
        return [(r.context, r.question, r.answers, r.answer_prefix) for r in rows]

    for folder in ("saved", "splits", "files"):
        rows = read_suite(tmp_path / folder).rows
        assert content(rows) == content(expected), folder
        assert rows[0].id == "capital" and rows[1].where == f"{folder} row 2"
    datasets.DatasetDict(
        {"a": datasets.Dataset.from_dict(columns), "b": datasets.Dataset.from_dict(columns)}
    ).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(KVRuntimeError, match=r"splits \['a', 'b'\] and none is 'test'"):
        read_suite(tmp_path / "two")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(KVRuntimeError, match="no dataset saved by datasets"):
        read_suite(tmp_path / "nothing")


def test_a_row_becomes_a_prompt_whose_context_is_compressed_before_its_question(tmp_path):
    from transformers import AutoTokenizer

    save_char_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    row = read_suite(write_jsonl(tmp_path / "mine.jsonl", ROWS)).rows[2]
    prompt = suite_prompt(row, tokenizer, chat=False, name="mine", scoring="f1")
    assert prompt.prompt[: prompt.question_start].startswith(row.context)
    assert prompt.prompt[prompt.question_start :].startswith(row.question) and prompt.prompt.endswith("Answer:")
    assert prompt.length == 256 and prompt.id == "line 3" and prompt.gold_text == "a red kite"
    assert [length_bucket(n) for n in (1, 256, 257, 1000, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]


def test_eval_resolves_each_contestant_once_per_run(tmp_path, monkeypatch):
    """Three prompts at two ratios: each compressing contestant's request is resolved once for the whole run (its
    options checked once, its artifact read once, its serving checked once, its method built once), not per
    (prompt, ratio)."""
    from conftest import scorer_that_prefers
    from test_serving import count_resolution
    from transformers import AutoTokenizer

    from kvruntime import model_fingerprint, save_artifact

    monkeypatch.chdir(tmp_path)
    save_char_tokenizer(tmp_path / "tok")
    model, tokenizer = tiny_model("llama"), AutoTokenizer.from_pretrained(tmp_path / "tok")
    monkeypatch.setattr(recipe, "load_model", lambda name, **_: (model, tokenizer))
    monkeypatch.setattr(recipe, "model_identity", lambda name: model_fingerprint(model))  # the tiny one
    save_artifact(scorer_that_prefers(model, 0), tmp_path / "compiled" / "distilled_scorer.safetensors")
    write_jsonl(tmp_path / "mine.jsonl", ROWS)
    calls: list = []
    count_resolution(monkeypatch, calls, ("distilled", "snapkv"))
    methods = "distilled:window=8,snapkv"
    args = ["eval", "--suite", "mine.jsonl", "--methods", methods, "--ratios", "0.5,0.75", "--artifacts", "compiled"]
    result = CliRunner().invoke(app, [*args, "--new-tokens", "1", "--out", "run"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in Path("run/runs.jsonl").read_text().splitlines()]
    assert len(records) == 3 * (1 + 2 * 2)  # every prompt: the full cache, each method at each ratio
    expected = ["window", ("header", "distilled_scorer.safetensors"), "tensors", "serving", "serving"]
    assert sorted(calls, key=str) == sorted([*expected, "build distilled", "build snapkv"], key=str)


def test_eval_and_tune_run_a_suite_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    save_char_tokenizer(tmp_path / "tok")
    model, tokenizer = tiny_model("llama"), AutoTokenizer.from_pretrained(tmp_path / "tok")
    monkeypatch.setattr(recipe, "load_model", lambda name, **_: (model, tokenizer))
    # The model answers "L" whatever its cache holds, so that each row's score is known: F1 of ["l"] against
    # "L" is 1; against "4417" 0 and "l l" 2/3 (the words a multiset), the best 2/3; against "The L." 1 (the article
    # and the full stop normalised away).
    forced = torch.full((model.config.vocab_size,), -1e4)
    forced[tokenizer.convert_tokens_to_ids("L")] = 0.0
    model.lm_head.register_forward_hook(lambda module, args, output: output + forced)
    scored = [{**row, "answers": answers} for row, answers in zip(ROWS, (["L"], ["4417", "l l"], ["The L."]))]
    write_jsonl(tmp_path / "mine.jsonl", scored)
    args = ["eval", "--suite", "mine.jsonl", "--scoring", "f1", "--methods", "snapkv", "--ratios", "0.5"]
    result = CliRunner().invoke(app, [*args, "--new-tokens", "1", "--out", "run"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in Path("run/runs.jsonl").read_text().splitlines()]
    assert len(records) == 6 and {r["task"] for r in records} == {"mine"}
    assert [r["id"] for r in records if r["method"] == "full"] == ["capital", "line 2", "line 3"]
    for method in ("full", "snapkv"):
        got = [r["correct"] for r in records if r["method"] == method]
        assert got == pytest.approx([1.0, 2 / 3, 1.0], abs=1e-4), method
    assert all(r["answer"] == "L" and r["depth"] is None for r in records)
    assert all(r["cache_kept"] == pytest.approx(0.5, abs=0.05) for r in records if r["method"] == "snapkv")
    assert json.loads(Path("run/run.json").read_text())["suite_sha256"] == read_suite(tmp_path / "mine.jsonl").sha256
    assert "3 prompts of the suite mine (sha256 " in Path("run/results.md").read_text()
    assert "scored by f1" in Path("run/results.md").read_text()
    rerun = next(line for line in Path("run/results.md").read_text().splitlines() if line.startswith("Command: "))
    assert "--suite mine.jsonl --scoring f1" in rerun and "--tasks" not in rerun and "--seed" not in rerun

    # The suite changed: resuming would mix two suites' records.
    write_jsonl(tmp_path / "mine.jsonl", ROWS[:2])
    refused = CliRunner().invoke(app, [*args, "--new-tokens", "1", "--out", "run", "--resume"])
    assert refused.exit_code == 2 and "other settings (suite_sha256 differ)" in refused.output

    # A prompt past the model's positions is refused before any prompt runs, naming its line.
    write_jsonl(tmp_path / "long.jsonl", [ROWS[0], {**ROWS[1], "context": "x" * 600}])
    long = CliRunner().invoke(app, ["eval", "--suite", "long.jsonl", "--methods", "snapkv", "--out", "long"])
    assert long.exit_code == 2 and "long.jsonl line 2: " in long.output and "more than the model's 512" in long.output
    assert not Path("long").exists()  # nothing written

    # A datasets folder runs the same way.
    import datasets

    columns = {key: [row.get(key, "") for row in ROWS] for key in ("id", "context", "question", "answers")}
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "saved"))
    saved = CliRunner().invoke(
        app,
        [
            "eval",
            "--suite",
            "saved",
            "--methods",
            "snapkv",
            "--ratios",
            "0.5",
            "--new-tokens",
            "2",
            "--out",
            "from_folder",
        ],
    )
    assert saved.exit_code == 0, saved.output
    folder_records = [json.loads(line) for line in Path("from_folder/runs.jsonl").read_text().splitlines()]
    assert [r["id"] for r in folder_records if r["method"] == "full"] == ["capital", "row 2", "row 3"]
    assert {r["task"] for r in folder_records} == {"saved"}

    tuned = CliRunner().invoke(
        app, ["tune", "--suite", "mine.jsonl", "--methods", "snapkv", "--ratios", "0.5", "--out", "tuned.safetensors"]
    )
    assert tuned.exit_code == 0, tuned.output
    from kvruntime.artifacts.artifact import read_artifact

    params = read_artifact(tmp_path / "tuned.safetensors").params
    assert params["suite"] == "mine" and params["scoring"] == "substring"


def _saved(folder: Path, rows: list[dict] = ROWS) -> Path:
    """`rows` saved as datasets saves them (state.json naming its Arrow file, dataset_info.json)."""
    import datasets

    columns = {key: [row.get(key, "") for row in rows] for key in FIELDS}
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder))
    return folder


def _state(folder: Path, **changes: object) -> Path:
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, **changes}))
    return folder


def _arrow_name(folder: Path) -> str:
    return json.loads((folder / "state.json").read_text())["_data_files"][0]["filename"]


def _split_outside(d: Path) -> Path:
    _saved(d / "outside"), _saved(d / "s" / "test")
    (d / "s" / "dataset_dict.json").write_text('{"splits": ["../outside"]}')
    return d / "s"


def _split_linked_out(d: Path) -> Path:
    _saved(d / "outside"), (d / "s").mkdir()
    (d / "s" / "test").symlink_to(d / "outside")
    (d / "s" / "dataset_dict.json").write_text('{"splits": ["test"]}')
    return d / "s"


def _arrow_linked_out(d: Path) -> Path:
    _saved(d / "outside"), _saved(d / "s")
    (d / "s" / _arrow_name(d / "s")).unlink()
    (d / "s" / _arrow_name(d / "s")).symlink_to(d / "outside" / _arrow_name(d / "outside"))
    return d / "s"


def _folder_with(d: Path, name: str, make: object) -> Path:
    (d / "s").mkdir()
    make(d / "s" / name)
    return d / "s"


def _fifo_suite(d: Path) -> Path:
    os.mkfifo(d / "pipe.jsonl")
    return d / "pipe.jsonl"


def _metadata(d: Path, text: str) -> Path:
    (_saved(d / "s") / "state.json").write_text(text)
    return d / "s"


def _odd_column(folder: Path) -> Path:
    import datasets

    columns = {"context": ["c"], "question": ["q"], "answers": [["a"]], "lenght": [3]}
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder))
    return folder


def _outside_state(d: Path, name: str) -> Path:
    _saved(d / "outside")
    return _state(_saved(d / "s"), _data_files=[{"filename": name}])


NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "make, message",
    [
        # The metadata names a file outside the folder (a good suite there: its rows must not be read).
        (lambda d: _outside_state(d, "../outside/data-00000-of-00001.arrow"),
         "state.json names '../outside/data-00000-of-00001.arrow': a suite's data files are .arrow files inside"),
        (lambda d: _outside_state(d, "/etc/passwd"), "names '/etc/passwd'"),
        (lambda d: _outside_state(d, "state.json"), "names 'state.json'"),
        (_split_outside, "dataset_dict.json lists no splits that are folders inside it"),
        # A link out of the folder, in place of a split or of a data file.
        (_split_linked_out, "test is not a folder of the suite"),
        (_arrow_linked_out, "data-00000-of-00001.arrow: a symbolic link"),
        (lambda d: _folder_with(d, "rows.jsonl", lambda p: p.symlink_to("/etc/passwd")), "rows.jsonl: a symbolic link"),
        # Special files: never read (a FIFO would block, /dev/zero never ends).
        (_fifo_suite, "not a file or a folder"),
        (lambda d: Path("/dev/zero"), "not a file or a folder"),
        (lambda d: _folder_with(d, "rows.jsonl", os.mkfifo), "rows.jsonl is not a plain file"),
        # Metadata that is not JSON, or nested past what a parser can read, is one line.
        (lambda d: _metadata(d, "{oops"), "state.json is not JSON"),
        (lambda d: _metadata(d, NESTED), "state.json is nested too deep to read"),
        (lambda d: _folder_with(d, "r.jsonl", lambda p: p.write_text(NESTED)), "r.jsonl line 1: nested too deep"),
        # A table's columns are checked before its rows are read.
        (lambda d: _odd_column(d / "s"), "unknown column 'lenght' (known: context, question, answers, answer_prefix, id)"),
    ],
)  # fmt: skip
def test_a_suite_folder_reads_only_its_own_plain_files(tmp_path, make, message):
    with pytest.raises(KVRuntimeError, match=re.escape(message)):
        read_suite(make(tmp_path))


def test_a_suite_folders_digest_covers_exactly_the_bytes_it_reads(tmp_path):
    folder = _saved(tmp_path / "s")
    first = read_suite(folder).sha256
    (folder / "notes.txt").write_text("the user's notes, not read")
    assert read_suite(folder).sha256 == first
    (folder / "dataset_info.json").write_text('{"description": "not read either"}')
    assert read_suite(folder).sha256 == first
    _saved(tmp_path / "other", [{**ROWS[0], "question": "Where does Ada work?"}, *ROWS[1:]])
    (folder / _arrow_name(folder)).write_bytes((tmp_path / "other" / _arrow_name(folder)).read_bytes())
    assert read_suite(folder).sha256 != first


def test_a_suite_folder_is_read_without_torch_or_a_cache_outside_it(tmp_path):
    """A state.json asking for torch tensors is read as the plain rows it holds; nothing is written to the
    datasets cache (HOME is an empty folder here, and stays one)."""
    folder = _state(_saved(tmp_path / "s"), _format_type="torch", _format_columns=["answers"])
    home = tmp_path / "home"
    home.mkdir()
    script = (
        "import importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('torch', 'datasets'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from pathlib import Path\n"
        "from kvcompile.tasks.own_suite import read_suite\n"
        f"print([row.id for row in read_suite(Path({str(folder)!r})).rows])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_"))}
    ran = subprocess.run(
        [sys.executable, "-P", "-c", script], env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "['capital', 'row 2', 'row 3']"
    assert list(home.iterdir()) == []
