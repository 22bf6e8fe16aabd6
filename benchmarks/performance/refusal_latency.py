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
import time
from pathlib import Path

from benchmarks.reporting import markdown_table, run_header, write_results

ROOT = Path(__file__).resolve().parents[2]  # the repository root
LIMIT_SECONDS = 0.5
LIMIT_MIB = 300
# Where PYTHONDONTWRITEBYTECODE is set every run compiles kvcompile's sources again (about 0.15-0.3 s more here).
BYTECODE_NOT_WRITTEN = "not written (PYTHONDONTWRITEBYTECODE set): every run compiles the sources again"
BYTECODE_CACHED = "cached (.pyc written once), as an installed package runs; run with `env -u PYTHONDONTWRITEBYTECODE`"
# issue #73: a memory bomb is refused under 300 MB


def refusal_cases() -> dict:
    spec = importlib.util.spec_from_file_location("refusal_cases", ROOT / "tests" / "test_refusals_before_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


# The run's own peak resident memory (VmHWM: this process's since its exec, not the forking parent's pages that
# wait4's ru_maxrss would count), written at exit to the file named by the first argument, which it takes out.
MEASURED = """
import atexit, re, sys
from pathlib import Path
peak_file = Path(sys.argv.pop(1))
atexit.register(lambda: peak_file.write_text(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text())[1]))
"""
CLI = MEASURED + "from kvcompile.cli import main\nsys.argv[0] = 'kvcompile'\nmain()\n"


def measured(code: str, *args: str) -> list[str]:
    """`python -c code args...`, its peak memory measured (`MEASURED`)."""
    return [sys.executable, "-P", "-c", code, *args]


def timed(make_command, folder: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds, peak resident MiB and the result of one run of `make_command(folder, peak_file)`."""
    env = {**os.environ, "KVCOMPILE_CACHE": str(folder / "cache")}
    peak_file = folder / ".peak_kib"
    command = make_command(folder, str(peak_file))
    started = time.perf_counter()
    result = subprocess.run(
        command, cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )
    seconds = time.perf_counter() - started
    return seconds, int(peak_file.read_text()) / 1024, result


def median_seconds(make_command, repeats: int) -> tuple[float, float, subprocess.CompletedProcess]:
    """The median wall seconds and the largest peak MiB over `repeats` runs, and the last run's result."""
    times, peaks, result = [], [], None
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            seconds, peak, result = timed(make_command, Path(folder))
        times.append(seconds)
        peaks.append(peak)
    return statistics.median(times), max(peaks), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("refusal_latency.md"))
    options = parser.parse_args()
    rows = []
    references = {
        'python -c "import torch"': lambda d, peak: measured(MEASURED + "import torch", peak),
        "kvcompile --help": lambda d, peak: measured(CLI, peak, "--help"),
    }
    for name, make in references.items():
        seconds, peak, _ = median_seconds(make, options.repeats)
        rows.append(
            {"case": name, "median_s": round(seconds, 3), "peak_mib": round(peak), "exit": 0, "under_limit": ""}
        )
    for name, (make_args, message) in refusal_cases().items():
        seconds, peak, result = median_seconds(
            lambda d, peak, make_args=make_args: measured(CLI, peak, *make_args(d)), options.repeats
        )
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
            *run_header(),
            "",
            f"Bytecode: {BYTECODE_NOT_WRITTEN if os.environ.get('PYTHONDONTWRITEBYTECODE') else BYTECODE_CACHED}",
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
