"""How long `kvcompile` takes to refuse bad input, and how much memory (issue #31: each refusal under 0.5 s, before
torch loads; issue #73: hostile models, GGUF files, suites and bundles refused under 300 MB).

Runs every refusal of tests/test_refusals_before_torch.py (the same cases, loaded from that file) as a user would,
`python -m kvcompile.cli ...` in a fresh folder, `--repeats` times each, and writes the median wall time per case
and the largest peak resident memory, beside `python -c "import torch"` and `kvcompile --help`, measured in the same
run, for scale:

    python -m benchmarks.performance.refusal_latency [--repeats 5] [--out benchmarks/performance/refusal_latency.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.reporting import machine, markdown_table, write_results

ROOT = Path(__file__).resolve().parents[2]  # the repository root
LIMIT_SECONDS = 0.5
LIMIT_MIB = 300  # issue #73: a memory bomb is refused under 300 MB


def refusal_cases() -> dict:
    spec = importlib.util.spec_from_file_location("refusal_cases", ROOT / "tests" / "test_refusals_before_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


def timed(command: list[str], folder: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds, peak resident MiB (the child's own, from wait4) and the result of one run."""
    env = {**os.environ, "KVCOMPILE_CACHE": str(folder / "cache")}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        deadline = threading.Timer(120, child.kill)  # a refusal that hangs is reported, not waited on forever
        deadline.start()
        _, status, usage = os.wait4(child.pid, 0)
        deadline.cancel()
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        result = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    return seconds, usage.ru_maxrss / 1024, result  # ru_maxrss is in KiB on Linux


def median_seconds(make_command, repeats: int) -> tuple[float, float, subprocess.CompletedProcess]:
    """The median wall seconds and the largest peak MiB over `repeats` runs, and the last run's result."""
    times, peaks, result = [], [], None
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            seconds, peak, result = timed(make_command(Path(folder)), Path(folder))
        times.append(seconds)
        peaks.append(peak)
    return statistics.median(times), max(peaks), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("refusal_latency.md"))
    options = parser.parse_args()
    cli = [sys.executable, "-P", "-m", "kvcompile.cli"]
    rows = []
    references = {
        'python -c "import torch"': lambda d: [sys.executable, "-P", "-c", "import torch"],
        "kvcompile --help": lambda d: [*cli, "--help"],
    }
    for name, make in references.items():
        seconds, peak, _ = median_seconds(make, options.repeats)
        rows.append(
            {"case": name, "median_s": round(seconds, 3), "peak_mib": round(peak), "exit": 0, "under_limit": ""}
        )
    for name, (make_args, message) in refusal_cases().items():
        seconds, peak, result = median_seconds(lambda d, make_args=make_args: [*cli, *make_args(d)], options.repeats)
        if result.returncode != 2 or message not in result.stderr:
            raise SystemExit(f"{name}: not refused as the test expects ({result.returncode}): {result.stderr[-500:]}")
        rows.append(
            {
                "case": name,
                "median_s": round(seconds, 3),
                "peak_mib": round(peak),
                "exit": result.returncode,
                "under_limit": "yes" if seconds < LIMIT_SECONDS and peak < LIMIT_MIB else "NO",
            }
        )
    refusals = [r["median_s"] for r in rows[len(references) :]]
    peaks = [r["peak_mib"] for r in rows[len(references) :]]
    markdown = "\n".join(
        [
            "# Refusal latency: how long bad input takes to be refused",
            "",
            f"Command: `python -m benchmarks.performance.refusal_latency --repeats {options.repeats}`  ",
            f"Machine: {machine()}  ",
            f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"{len(refusals)} refusals (the cases of tests/test_refusals_before_torch.py), median of {options.repeats} "
            f"runs each, as `python -m kvcompile.cli ...` in a fresh folder: slowest {max(refusals):.3f} s, median "
            f"{statistics.median(refusals):.3f} s; {sum(s < LIMIT_SECONDS for s in refusals)} of {len(refusals)} under "
            f"{LIMIT_SECONDS} s. Peak resident memory of each run (the child's own): at most {max(peaks)} MiB, limit "
            f"{LIMIT_MIB}. For scale, the first two rows: importing torch alone, and the help text.",
            "",
            *markdown_table(rows),
            "",
        ]
    )
    write_results(rows, options.out, markdown)


if __name__ == "__main__":
    main()
