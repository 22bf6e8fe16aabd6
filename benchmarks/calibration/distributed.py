"""Wall time of a compile command on the default model: one process against torchrun ranks on the same machine,
and whether their artifacts are bit-identical. Each configuration runs in turn, as a subprocess; the same cores
serve both, so the ratio says how well the work splits (on a 2-core machine two 1-thread ranks compete with one
2-thread process).

    python -m benchmarks.calibration.distributed [--ranks 2] [--command "stats --prompts 8 --prompt-tokens 1024"]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.reporting import run_header, write_results
from kvruntime.artifacts.artifact import read_artifact


def timed(args: list[str], folder: Path, threads: int) -> float:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    started = time.perf_counter()
    subprocess.run(args, cwd=folder, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--command", default="stats --prompts 8 --prompt-tokens 1024")
    options = parser.parse_args()
    cores = os.cpu_count() or 1
    command = ["kvcompile", *shlex.split(options.command)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        alone = timed([*command, "--out", "alone.safetensors"], folder, threads=cores)
        together = timed(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(options.ranks),
                "--no-python",
                *command,
                "--out",
                "ranks.safetensors",
            ],
            folder,
            threads=max(1, cores // options.ranks),
        )
        one, many = read_artifact(folder / "alone.safetensors"), read_artifact(folder / "ranks.safetensors")
        identical = one.params == many.params and all(torch.equal(t, many.tensors[n]) for n, t in one.tensors.items())
    rows = [
        {"run": f"1 process, {cores} threads", "seconds": round(alone, 1), "ratio": 1.0},
        {
            "run": f"torchrun, {options.ranks} ranks x {max(1, cores // options.ranks)} threads",
            "seconds": round(together, 1),
            "ratio": round(together / alone, 2),
        },
    ]
    table = "\n".join(
        [
            "# Distributed calibration: one process against torchrun ranks",
            "",
            *run_header(),
            f"Compile command: `kvcompile {options.command}` (model loading included in each run).  ",
            f"Artifacts bit-identical: {'yes' if identical else 'NO'}",
            "",
            "| run | seconds | time vs one process |",
            "|---|---|---|",
            *[f"| {r['run']} | {r['seconds']} | {r['ratio']} |" for r in rows],
            "",
        ]
    )
    write_results(rows, Path(__file__).with_name("distributed_calibration.md"), table)


if __name__ == "__main__":
    main()
