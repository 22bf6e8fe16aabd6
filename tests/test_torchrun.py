"""The torchrun commands of docs/calibration.md, run on the CPU with 2 ranks on the default model (smaller grids):
the artifacts equal those of one process, and every rank's checkpoint is gone afterwards."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvruntime.artifacts.artifact import read_artifact

pytestmark = pytest.mark.integration
README = Path(__file__).resolve().parents[1] / "docs" / "calibration.md"
SMALLER = {
    "heads": ["--lengths", "192", "--depths", "0.5"],  # one probe per needle: the ranks share the needles
    "stats": ["--prompts", "2", "--prompt-tokens", "256"],
    # The lookahead queries' training (400 steps by default) would dwarf the distributed part under test.
    "distill": [
        *("--prompts", "4", "--prompt-tokens", "192", "--lookahead-steps", "4", "--lookahead-prompts", "2"),
        *("--lookahead-held-out", "1", "--lookahead-tokens", "128"),
    ],
}


def readme_torchrun_commands() -> list[list[str]]:
    return [shlex.split(line) for line in re.findall(r"^torchrun --.*$", README.read_text(), flags=re.M)]


def run(args: list[str], folder: Path) -> None:
    bin_folder = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_folder + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1"}
    result = subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("command", ["heads", "stats", "distill"])
def test_the_readme_torchrun_command_writes_the_artifact_of_one_process(tmp_path, command):
    torchrun = next(c for c in readme_torchrun_commands() if command in c)
    assert torchrun[:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", "--no-python"]
    kvcompile = torchrun[torchrun.index("kvcompile") :]
    run(
        [sys.executable, "-m", "torch.distributed.run", *torchrun[1:], *SMALLER[command], "--out", "ranks.safetensors"],
        tmp_path,
    )
    run([*kvcompile, *SMALLER[command], "--out", "alone.safetensors"], tmp_path)
    ranks, alone = read_artifact(tmp_path / "ranks.safetensors"), read_artifact(tmp_path / "alone.safetensors")
    assert ranks.params == alone.params and ranks.model == alone.model
    for name, tensor in alone.tensors.items():
        assert torch.equal(tensor, ranks.tensors[name]), name
    assert not list(tmp_path.glob("*.partial"))
