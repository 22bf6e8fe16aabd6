"""Every refusal of a bad argument, a bad option, a missing file or folder, an unknown task or oracle comes before
torch or transformers is imported (issue #31): each command runs in a subprocess whose import system refuses
torch and transformers, so a refusal that came after importing them would end in an ImportError traceback (exit 1)
instead of its one line (exit 2). The refusals' time is measured in benchmarks/performance/refusal_latency.py, not
here."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcompile.recipe import artifact_folder

ARTIFACTS = artifact_folder("default")
PROMPT = str(Path(__file__).resolve().parent.parent / "calibration_data" / "prompts" / "passkey_2k.txt")
# The command line with torch and transformers made unimportable: what it refuses, it refuses without them.
BLOCKED_MAIN = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            raise ImportError(name + " imported before the refusal")
sys.meta_path.insert(0, Refuse())
from kvcompile.cli import main
sys.argv[0] = "kvcompile"
main()
"""


def run_blocked(args: list[str], folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCOMPILE_CACHE": str(folder / "cache")}
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_MAIN, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=60
    )


def _fifo(folder: Path) -> str:
    os.mkfifo(folder / "pipe")
    return "pipe"


def _user_file(folder: Path, name: str) -> str:
    (folder / name).write_text("the user's own file\n")
    return name


def _user_folder(folder: Path, name: str) -> str:
    (folder / name).mkdir()
    (folder / name / "notes.txt").write_text("the user's own file\n")
    return name


def _text(folder: Path, name: str, text: str) -> str:
    (folder / name).write_text(text)
    return name


GENERATE = ["generate", "--prompt-file", PROMPT]
# name -> (arguments, made in the folder the command runs in; a part of the one line it must print)
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "missing prompt": (lambda d: ["generate", "--prompt-file", "nope.txt"], "prompt file nope.txt does not exist"),
    "prompt is a pipe": (
        lambda d: ["generate", "--prompt-file", _fifo(d)],
        "prompt file pipe is not a regular file",
    ),
    "unknown method": (lambda d: [*GENERATE, "--method", "foo"], "unknown method 'foo'"),
    "a JSONL line that is not JSON": (
        lambda d: ["generate", "--prompt-file", _text(d, "p.jsonl", '"a prompt"\n{oops\n')],
        "line 2 of p.jsonl is not JSON",
    ),
    "a JSONL line without a prompt": (
        lambda d: ["generate", "--prompt-file", _text(d, "q.jsonl", '{"text": "no prompt key"}\n')],
        "line 1 of q.jsonl holds no prompt",
    ),
    "a batch of no prompts": (
        lambda d: [*GENERATE, "--batch-size", "0"],
        "--batch-size 0: give at least 1 prompt per batch",
    ),
    "option of the wrong type": (
        lambda d: [*GENERATE, "--method", "kvcompose", "--option", "unstructured=maybe"],
        "kvcompose option unstructured='maybe' is not a boolean",
    ),
    "unstructured with padded memory": (
        lambda d: [*GENERATE, "--method", "kvcompose", "--option", "unstructured=true", "--option", "mode=dynamic"],
        "use memory='masked'",
    ),
    "budget not compiled for compilerkv, without nearest budget": (
        lambda d: [*GENERATE, "--method", "compilerkv", "--budget", "300"],
        "not 300: pass it (--budget)",
    ),
    "budget compilerkv did not compile": (
        lambda d: [*GENERATE, "--method", "compilerkv", "--budget", "300"],
        "compiled for budget 256 tokens per layer, not 300",
    ),
    "ratio outside kvcompose's compiled ratios": (
        lambda d: [*GENERATE, "--method", "kvcompose", "--ratio", "0.99"],
        "ratio 0.99 is outside the compiled ratios",
    ),
    "chunks for a method that cannot stream": (
        lambda d: [*GENERATE, "--method", "kvcompress", "--prefill-chunk-size", "512"],
        "kvcompress cannot stream the prefill in chunks",
    ),
    "chunk smaller than the tuned default's window": (
        lambda d: [*GENERATE, "--prefill-chunk-size", "4"],
        "prefill_chunk_size 4 is smaller than compresskv's window of 8 tokens",
    ),
    "chunk size not a number": (
        lambda d: [*GENERATE, "--prefill-chunk-size", "abc"],
        "Invalid value for '--prefill-chunk-size'",
    ),
    "missing artifact without a method": (
        lambda d: [*GENERATE, "--artifact", "nope.safetensors"],
        "nope.safetensors: no such artifact file",
    ),
    "budget past the model's positions": (
        lambda d: [*GENERATE, "--method", "snapkv", "--budget", "99999999999"],
        "--budget 99999999999 tokens per layer: 99999999999 positions, more than the model's 8192",
    ),
    "missing model folder": (
        lambda d: [*GENERATE, "--method", "snapkv", "--model", str(d / "no-model")],
        "not found: give a local model directory",
    ),
    "eval: unknown task": (lambda d: ["eval", "--tasks", "foo"], "unknown tasks ['foo']"),
    "eval: a length past the model's positions": (
        lambda d: ["eval", "--lengths", "20k", "--methods", "snapkv"],
        "--lengths 20480 and 48 new tokens: 20528 positions, more than the model's 8192",
    ),
    "eval: unknown method": (lambda d: ["eval", "--methods", "foo"], "unknown method 'foo'"),
    "eval: a batch of no prompts": (
        lambda d: ["eval", "--methods", "snapkv", "--batch-size", "0"],
        "--batch-size 0: give at least 1 prompt per batch",
    ),
    "eval: an output folder of other files": (
        lambda d: ["eval", "--methods", "snapkv", "--out", _user_folder(d, "mine")],
        "--out mine holds files that are not a kvcompile run's",
    ),
    "distill: unknown oracle": (lambda d: ["distill", "--oracle", "foo"], "--oracle 'foo': use one of"),
    "distill: --out a picture's name": (
        lambda d: ["distill", "--out", "x.png"],
        "--out x.png: an artifact's name ends in .safetensors",
    ),
    "distill: --out a file that is not its artifact": (
        lambda d: ["distill", "--out", _user_file(d, "mine.safetensors")],
        "--out mine.safetensors exists and is not a distilled_scorer or partial_statistics artifact",
    ),
    "distill: the picture's name taken by another file": (
        lambda d: ["distill", "--out", "s.safetensors", "--corpus", _user_file(d, "s.png")],
        "its picture's name s.png is taken by a file that is not a PNG",
    ),
    "distill: --out in a folder nothing can be written in": (
        lambda d: ["distill", "--out", "/proc/kvcompile-test.safetensors"],
        "--out /proc/kvcompile-test.safetensors: cannot write in /proc",
    ),
    "distill: a length past the model's positions": (
        lambda d: ["distill", "--prompt-tokens", "5000"],
        "--prompt-tokens 5000 read twice (the second pass): 10000 positions, more than the model's 8192",
    ),
    "stats: ratio out of range": (lambda d: ["stats", "--ratios", "1.5"], "--ratios [1.5]: give ratios strictly"),
    "stats: missing task set": (
        lambda d: ["stats", "--task-set", "nope.txt", "--out", "s.safetensors"],
        "task set nope.txt does not exist",
    ),
    "stats: missing corpus": (
        lambda d: ["stats", "--corpus", "nope.txt", "--out", "s.safetensors"],
        "corpus nope.txt does not exist",
    ),
    "tune: unknown method": (lambda d: ["tune", "--methods", "foo"], "unknown method 'foo'"),
    "tune: the run records' folder taken by other files": (
        lambda d: ["tune", "--methods", "snapkv", "--out", _user_folder(d, "t.runs").replace(".runs", ".safetensors")],
        "t.runs holds files that are not a kvcompile run's",
    ),
    "heads: a length past the model's positions": (
        lambda d: ["heads", "--lengths", "99999"],
        "--lengths 99999: 99999 positions, more than the model's 8192",
    ),
    "tables: budget below the window": (lambda d: ["tables", "--budgets", "0"], "--budgets must lie between"),
    "tables: an unknown experience design": (lambda d: ["tables", "--design", "all"], "--design 'all': choose one of"),
    "tables: an unknown loss": (lambda d: ["tables", "--loss", "mse"], "--loss 'mse': choose one of nll, kl"),
    "tables: the experience's name taken by another file": (
        lambda d: ["tables", "--out", _user_file(d, "t.experience.safetensors").replace(".experience", "")],
        "t.experience.safetensors exists and is not a compilerkv_experience artifact",
    ),
    "tables: relearning from an artifact of another kind": (
        lambda d: ["tables", "--from-experience", str(ARTIFACTS / "srh_heads.safetensors"), "--out", "t.safetensors"],
        "a srh_heads artifact, not compilerkv_experience",
    ),
    "budgets: missing heads artifact": (
        lambda d: ["budgets", "--heads", "nope.safetensors", "--out", "b.safetensors"],
        "nope.safetensors: no such artifact file",
    ),
    "unknown device": (lambda d: ["stats", "--device", "tpu"], "--device 'tpu': use cpu, cuda, cuda:N or mps"),
    "unknown dtype": (lambda d: ["stats", "--dtype", "int8"], "--dtype 'int8': use one of"),
    "bad shard": (lambda d: ["stats", "--shard", "3/2"], "--shard '3/2': i must lie in [0, n)"),
    "merge: --out one of the partials": (
        lambda d: ["merge", _user_file(d, "a.safetensors"), "--out", "a.safetensors"],
        "--out a.safetensors is one of the partials being merged",
    ),
    "merge: a missing partial": (
        lambda d: ["merge", "nope.safetensors", "--out", "m.safetensors"],
        "nope.safetensors: no such artifact file",
    ),
    "merge: not partial statistics": (
        lambda d: ["merge", str(ARTIFACTS / "srh_heads.safetensors"), "--out", "m.safetensors"],
        "is not partial statistics",
    ),
    "info: a missing file": (lambda d: ["info", "nope.safetensors"], "nope.safetensors: no such artifact file"),
    "info: not an artifact": (
        lambda d: ["info", _text(d, "notes.safetensors", "notes")],
        "not a readable safetensors file",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_in_one_line_before_torch_is_imported(tmp_path, case):
    make, message = CASES[case]
    args = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_blocked(args, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == before  # nothing written


def test_the_blocker_catches_a_refusal_made_after_torch_loads(tmp_path):
    """The harness itself: a command that gets as far as loading the model fails here, loudly."""
    result = run_blocked([*GENERATE, "--method", "snapkv", "--max-new-tokens", "1"], tmp_path)
    assert result.returncode == 1 and "imported before the refusal" in result.stderr
