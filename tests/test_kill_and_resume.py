"""kill -9 at random moments of a compile run (tiny model, its own process), then `resume`: the same artifact as
an uninterrupted run, never a half-written file, and every resumed run carries on from where the last was killed."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kill_worker import compile_recipe
from safetensors import safe_open

from kvcompile.calibration.checkpoint import checkpoint_path
from kvruntime.artifacts.artifact import read_artifact

WORKER = Path(__file__).with_name("kill_worker.py")


def start(recipe: str, folder: Path, resume: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path]), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(WORKER), recipe, str(folder)] + (["--resume"] if resume else [])
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def progress(checkpoint: Path) -> tuple:
    """How far the run had got when it saved `checkpoint`: (items done), or (round, phase, unit) for the tables."""
    with safe_open(str(checkpoint), framework="pt") as handle:
        saved = json.loads(handle.metadata()["progress"])
    if "items_done" in saved:
        return (saved["items_done"],)
    return (saved["round"], saved["phase"], saved["unit"])


def kill_after_some_checkpoints(process: subprocess.Popen, checkpoint: Path, rng: random.Random) -> tuple:
    """Wait until the run has saved at least once more, then kill -9 it a random few milliseconds later. Returns
    the progress of the first save the run made."""
    before = checkpoint.stat().st_mtime_ns if checkpoint.exists() else None
    deadline = time.monotonic() + 120
    while (not checkpoint.exists() or checkpoint.stat().st_mtime_ns == before) and process.poll() is None:
        assert time.monotonic() < deadline, "the run saved no checkpoint in 2 minutes"
        time.sleep(0.002)
    first = progress(checkpoint)
    time.sleep(rng.uniform(0, 0.05))
    process.send_signal(signal.SIGKILL)
    process.wait()
    return first


@pytest.mark.parametrize("recipe", ["stats", "tables"])
def test_a_run_killed_three_times_resumes_to_the_artifact_of_an_uninterrupted_run(tmp_path, recipe):
    threads = torch.get_num_threads()
    try:
        straight = compile_recipe(recipe, tmp_path / "straight", resume=False)
    finally:
        torch.set_num_threads(threads)
    folder = tmp_path / "killed"
    folder.mkdir()
    out, checkpoint = folder / f"{recipe}.safetensors", checkpoint_path(folder / f"{recipe}.safetensors")
    rng, killed_at = random.Random(0), None
    for attempt in range(3):
        process = start(recipe, folder, resume=attempt > 0)
        first_save = kill_after_some_checkpoints(process, checkpoint, rng)
        assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed: make it longer"
        # A resumed run carries on from where it was killed: its first save is past that point (one that started
        # over would save its first item or unit again).
        assert killed_at is None or first_save > killed_at, (first_save, killed_at)
        killed_at = progress(checkpoint)
        assert not out.exists()
        # Whatever moment the kill hit, only whole files are left under their final names.
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [checkpoint.name]
    finished = start(recipe, folder, resume=True)
    assert finished.wait(timeout=300) == 0
    resumed = read_artifact(out)
    assert resumed.params == json.loads(json.dumps(straight.params))
    for name, tensor in straight.tensors.items():
        assert torch.equal(tensor, resumed.tensors[name]), name


def test_a_run_ended_by_sigterm_releases_its_lock_and_says_aborted(tmp_path):
    """`timeout` and `kill` send SIGTERM: the run unwinds as Ctrl-C does (issue #48: it used to leave its lock)."""
    from conftest import save_char_tokenizer, tiny_model

    model_folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_folder)
    save_char_tokenizer(model_folder)
    locks = tmp_path / "cache" / "locks"
    env = {**os.environ, "KVCOMPILE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    args = [
        "stats",
        "--model",
        str(model_folder),
        "--prompts",
        "400",
        "--prompt-tokens",
        "256",
        "--out",
        "s.safetensors",
    ]
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvcompile.cli", *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not list(locks.glob("*.lock")):  # the run holds its output's lock once it has checked its input
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "aborted"
    assert list(locks.glob("*.lock")) == []
    assert not (tmp_path / "s.safetensors").exists()
