"""Nothing a user owns is overwritten or deleted, nothing past the model's limits runs silently (issue #31).

Compile commands run on a tiny Llama (`recipe.load_model` replaced). The refusals that need no model are in
tests/test_refusals_before_torch.py (with torch made unimportable); here: what happens once work has begun: write
failures at every write of a compile (fault-injected), the run records of `tune`, the experience of `tables`,
prompts past the model's positions, and the lock files."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from conftest import TINY, CharTokenizer, tiny_model
from test_bad_input import TensorTokenizer
from typer.testing import CliRunner

import kvcompile.cli as cli
import kvruntime
from kvcompile import recipe
from kvcompile.evaluation.store import discard_run_records
from kvcompile.recipes.compilerkv.recipe import TablesRecipe
from kvcompile.recipes.compilerkv.settings import experience_path
from kvruntime import KVRuntimeError, read_artifact
from kvruntime.files import cache_root, path_lock

runner = CliRunner()
LLAMA = tiny_model("llama")
STATS = ["stats", "--corpus", "corpus.txt", "--prompts", "2", "--prompt-tokens", "96", "--checkpoint-every", "1"]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (LLAMA, CharTokenizer()))
    (tmp_path / "corpus.txt").write_text("Some calibration text, and more of it. " * 200)
    (tmp_path / "out").mkdir()
    return tmp_path


def temporary_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.tmp"))


class FailingWrite:
    """`os.fsync` (every atomic write calls it once, between writing the temporary file and renaming it) that fails
    on call number `at` in one of three ways: a full disk, a permission lost, or the output folder removed."""

    def __init__(self, at: int, how: str, folder: Path) -> None:
        self.at, self.how, self.folder, self.calls = at, how, folder, 0
        self.real = os.fsync

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.calls == self.at:
            if self.how == "ENOSPC":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self.how == "EACCES":
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            shutil.rmtree(self.folder)  # the folder removed mid-run: the rename has nowhere to go
        self.real(fd)


def test_a_compile_counts_its_writes(workdir, monkeypatch):
    """The fault-injection test below fails each of these writes in turn: the checkpoint after the first prompt
    (the last prompt's goes straight into the artifact), the artifact, its run record, its picture (a change in
    that count changes which write is which, so it is pinned here)."""
    counter = FailingWrite(at=0, how="ENOSPC", folder=workdir / "out")
    monkeypatch.setattr(os, "fsync", counter)
    result = runner.invoke(cli.app, [*STATS, "--out", "out/s.safetensors"])
    assert result.exit_code == 0, result.output
    assert counter.calls == 4


@pytest.mark.parametrize("how", ["ENOSPC", "EACCES", "folder removed"])
@pytest.mark.parametrize("at", [1, 2, 3, 4])
def test_a_write_failure_anywhere_in_a_compile_is_one_line_and_loses_nothing(workdir, monkeypatch, how, at):
    """An earlier artifact at --out stays whole (the old one, or the new one once its rename went through), and no
    temporary file is left, whichever write fails and however."""
    assert runner.invoke(cli.app, [*STATS, "--out", "out/s.safetensors", "--seed", "1"]).exit_code == 0
    old = (workdir / "out" / "s.safetensors").read_bytes()
    monkeypatch.setattr(os, "fsync", FailingWrite(at, how, workdir / "out"))
    result = runner.invoke(cli.app, [*STATS, "--out", "out/s.safetensors"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: cannot write out/") and "Traceback" not in result.output
    monkeypatch.undo()
    if how == "folder removed":
        assert not (workdir / "out").exists() or temporary_files(workdir / "out") == []
        return
    assert temporary_files(workdir) == []
    artifact = workdir / "out" / "s.safetensors"
    if at <= 2:  # the checkpoint or the artifact's own write failed: the earlier artifact is untouched
        assert artifact.read_bytes() == old
    else:  # the run record or the picture failed after the new artifact was renamed into place: the new one, whole
        assert artifact.read_bytes() != old and read_artifact(artifact).kind == "kvcompose_stats"


def test_an_output_folder_that_cannot_be_written_is_refused_by_trying(workdir, monkeypatch):
    """Permission bits can say yes where writing fails (a read-only mount, /proc): the check creates a file."""

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(recipe, "load_model", None)  # the refusal comes before the model is loaded
    monkeypatch.setattr("tempfile.mkstemp", read_only)
    result = runner.invoke(cli.app, [*STATS, "--out", "out/s.safetensors"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "--out out/s.safetensors: cannot write in" in result.output and "Read-only file system" in result.output


def test_tables_runs_into_one_folder_keep_their_own_experience():
    """Each --out has its own experience file, never another run's and never the tables' own name."""
    outs = [
        Path("d/compilerkv_tables.safetensors"),
        Path("d/other.safetensors"),
        Path("d/compilerkv_experience.safetensors"),
    ]
    experiences = [experience_path(out) for out in outs]
    assert len(set(experiences)) == len(outs) and not set(experiences) & set(outs)
    assert experiences[0] == Path("d/compilerkv_tables.experience.safetensors")  # the shipped one's name
    assert TablesRecipe().companions(outs[1]) == {experiences[1]: "compilerkv_experience"}
    assert TablesRecipe(from_experience=experiences[0]).companions(outs[1]) == {}  # relearning writes none


def test_tune_removes_only_its_own_run_records(tmp_path):
    records = tmp_path / "t.runs"
    records.mkdir()
    for name in ("run.json", "runs.jsonl"):
        (records / name).write_text("{}\n")
    discard_run_records(records)
    assert not records.exists()
    records.mkdir()
    (records / "runs.jsonl").write_text("{}\n")
    (records / "notes.txt").write_text("the user's")
    discard_run_records(records)
    assert sorted(p.name for p in records.iterdir()) == ["notes.txt"]


def test_a_prompt_past_the_models_positions_is_refused_by_the_runtime():
    ids = torch.randint(3, TINY["vocab_size"], (1, TINY["max_position_embeddings"] + 1))
    with kvruntime.compress(LLAMA, "snapkv", ratio=0.5) as session:
        with pytest.raises(KVRuntimeError, match=r"a prompt of 513 tokens: 513 positions, more than the model's 512"):
            session.prefill(ids)
        with pytest.raises(KVRuntimeError, match="more than the model's 512"):
            LLAMA.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1)
        session.prefill(ids[:, :512])  # at the limit it runs


class DecodingTokenizer(TensorTokenizer):
    def decode(self, ids: torch.Tensor, skip_special_tokens: bool = False) -> str:
        return "".join(chr(int(i)) for i in ids)


def test_generate_refuses_a_prompt_whose_answer_would_pass_the_models_positions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(recipe, "load_model", lambda model, **_: (LLAMA, DecodingTokenizer()))
    (tmp_path / "long.txt").write_text("x" * 500)
    args = ["generate", "--prompt-file", "long.txt", "--method", "snapkv", "--prompt-format", "raw"]
    result = runner.invoke(cli.app, [*args, "--max-new-tokens", "20"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert (
        "prompt file long.txt (500 tokens) and 20 new tokens: 520 positions, more than the model's 512" in result.output
    )
    assert runner.invoke(cli.app, [*args, "--max-new-tokens", "12"]).exit_code == 0


@pytest.mark.parametrize(
    "request_, message",
    [
        (dict(ratio="0.5"), "ratio '0.5' is not a number"),
        (dict(ratio=True), "ratio True is not a number"),
        (dict(budget=50.5), "budget 50.5 is not a whole number of tokens per layer"),
        (dict(budget="64"), "budget '64' is not a whole number of tokens per layer"),
    ],
)
def test_the_api_refuses_a_ratio_or_budget_of_the_wrong_type_at_the_request(request_, message):
    with pytest.raises(KVRuntimeError, match=message):
        kvruntime.compress(LLAMA, "snapkv", **request_).__enter__()


def test_lock_files_are_removed_when_released(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    for name in ("a.safetensors", "b.safetensors"):
        with path_lock(tmp_path / name, wait=False):
            assert len(list((cache_root() / "locks").iterdir())) == 1
    assert list((cache_root() / "locks").iterdir()) == []


def test_a_waiting_lock_taken_on_a_removed_lock_file_is_taken_again(tmp_path, monkeypatch):
    """The holder removes the lock file as it releases; a waiter that opened the old file must not think it holds
    the lock while a third process locks the new file."""
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "s.safetensors"
    order = []
    first = path_lock(target, wait=True)
    first.__enter__()

    def waiter() -> None:
        with path_lock(target, wait=True):
            order.append("waiter holds")
            try:  # a third taker must find the lock held
                with path_lock(target, wait=False):
                    order.append("third also holds")
            except KVRuntimeError:
                order.append("third refused")

    asked = threading.Event()  # the waiter reached its blocking flock (a wait that saw it, not a sleep)
    real_flock = fcntl.flock

    def flock(handle: object, operation: int) -> None:
        if operation == fcntl.LOCK_EX and threading.current_thread() is thread:
            asked.set()
        real_flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    thread = threading.Thread(target=waiter)
    thread.start()
    assert asked.wait(timeout=10)
    assert order == [] and thread.is_alive()  # the lock is held: the waiter waits
    first.__exit__(None, None, None)
    thread.join(timeout=10)
    assert order == ["waiter holds", "third refused"]
    assert list((cache_root() / "locks").iterdir()) == []
