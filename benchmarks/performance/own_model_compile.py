"""`kvcompile compile` end to end on a model given only as a file (issue #75): every artifact every method needs,
compiled into an empty store; each recipe's wall time (its artifact's run record) against the estimate the command
printed before it started; then every method's `generate` on the shipped pass-key prompt, without `--artifact`.

    python -m benchmarks.performance.own_model_compile (--model PATH | --gemma-variant) [--minutes 60]
        [--cache DIR] [--out FILE.md]

`--gemma-variant`: the shipped Gemma 3 270M GGUF with one norm scaled by 1.02 (`blk.17.post_ffw_norm`, a weight the
fingerprint hashes), written into the cache: real weights no artifact was compiled for. `--cache` keeps the store
(and the converted model) between runs: a rerun resumes, or only collects what is done.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.cli.compile_all import PLAN_FILE
from kvruntime.registry import METHOD_NAMES

PROMPT = Path("calibration_data/prompts/passkey_2k.txt")
KEY = "25613"  # the pass key the prompt hides
STATE = re.compile(r"^(\w+): (?:have|will compile) \((.+)\)$", re.MULTILINE)


def kvcompile(arguments: list[str], cache: Path) -> subprocess.CompletedProcess:
    """One `kvcompile` command in a child process with `cache` as its KVCOMPILE_CACHE, its output captured."""
    child = [sys.executable, "-m", "kvcompile.cli", *arguments]
    return subprocess.run(child, env={**os.environ, "KVCOMPILE_CACHE": str(cache)}, capture_output=True, text=True)


def compile_model(model: str, minutes: float, cache: Path) -> tuple[str, float]:
    """`kvcompile compile` with its progress shown as it goes: what it said, and its wall time."""
    started = time.perf_counter()
    child = [sys.executable, "-m", "kvcompile.cli", "compile", "--model", model, "--minutes", f"{minutes:g}"]
    process = subprocess.Popen(
        child, env={**os.environ, "KVCOMPILE_CACHE": str(cache)}, stderr=subprocess.PIPE, text=True
    )
    said = []
    for chunk in iter(lambda: process.stderr.read(256), ""):
        sys.stderr.write(chunk)
        said.append(chunk)
    if process.wait() != 0:
        raise SystemExit(f"kvcompile compile failed ({process.returncode})")
    return "".join(said), time.perf_counter() - started


def gemma_variant(folder: Path) -> Path:
    """A copy of the shipped Gemma GGUF whose `blk.17.post_ffw_norm` is scaled by 1.02: other weights, same model."""
    import shutil

    import numpy as np
    from gguf import GGUFReader

    from kvruntime.models.default_model import gguf_of

    path = folder / "gemma-variant.gguf"
    if not path.exists():
        shutil.copyfile(gguf_of("gemma-3-270m"), path.with_suffix(".tmp"))
        reader = GGUFReader(path.with_suffix(".tmp"), "r+")
        norm = next(tensor for tensor in reader.tensors if tensor.name == "blk.17.post_ffw_norm.weight")
        norm.data[:] = norm.data * np.float32(1.02)
        del reader
        path.with_suffix(".tmp").replace(path)
    return path


def markdown_cell(text: str) -> str:
    """A model's answer as one table cell: its first line, pipes and Markdown escaped."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return re.sub(r"([\\`*_|<>\[\]#])", r"\\\1", line[:60])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--model")
    given.add_argument("--gemma-variant", action="store_true")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/performance/own_model_compile.md"))
    args = parser.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="kvcompile-cache-"))
    cache.mkdir(parents=True, exist_ok=True)
    if args.gemma_variant:
        args.model = str(gemma_variant(cache))
    said, wall = compile_model(args.model, args.minutes, cache)
    rows = []
    for kind, path in STATE.findall(said):
        record = json.loads(Path(path).with_suffix(".run.json").read_text())
        estimate = round(json.loads((Path(path).parent / PLAN_FILE).read_text())["estimated_seconds"][kind])
        rows.append({
            "artifact": kind, "estimated_s": estimate, "compile_s": round(record["compile_seconds"]),
            "compile_over_estimate": round(record["compile_seconds"] / estimate, 2), "command": f"`{record['command_line']}`",
        })  # fmt: skip
    estimated, total = (sum(row[key] for row in rows) for key in ("estimated_s", "compile_s"))
    rows.append({"artifact": "all", "estimated_s": estimated, "compile_s": total,
                 "compile_over_estimate": round(total / estimated, 2),
                 "command": f"`kvcompile compile`'s wall time, its probe and the loads included: {wall:.0f} s"})  # fmt: skip
    methods = []
    for method in METHOD_NAMES:
        arguments = ["generate", "--model", args.model, "--method", method, "--prompt-file", str(PROMPT)]
        started = time.perf_counter()
        answered = kvcompile([*arguments, "--max-new-tokens", "12"], cache)
        seconds = time.perf_counter() - started
        methods.append({"method": method, "exit_code": answered.returncode, "seconds": round(seconds),
                        "key_kept": KEY in answered.stdout, "answer": markdown_cell(answered.stdout or answered.stderr)})  # fmt: skip
    header = [
        "# `kvcompile compile` on a model given only as a file: times per recipe, then every method",
        "",
        *run_header(),
        "Store: an empty `KVCOMPILE_CACHE` (the model converted "
        "into it first). `estimated_s`: what `kvcompile compile` estimated before it started (kept in the store's "
        f"`{PLAN_FILE}`); `compile_s`: each artifact's recorded wall time.",
        "",
        *markdown_table(rows),
        "",
        f"Every method without `--artifact`, `kvcompile generate --model {args.model} --method M --prompt-file "
        f"{PROMPT}` (pass key {KEY}, each method's default ratio or budget):",
        "",
        *markdown_table(methods),
        "",
    ]
    write_results(rows + methods, args.out, "\n".join(header))


if __name__ == "__main__":
    main()
