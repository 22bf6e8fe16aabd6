"""An eval run's measured table as a bundle carries it (`kvcompile bundle --results <eval folder>`): accuracy and
fidelity per method and ratio against the full cache, the prompts' source and count, and the command that reruns
it, read from the run's records (`run.json`, `runs.jsonl`) and its report's command line. The folder may come from
anyone: every value is checked before it is used, and no text from it is printed unescaped."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcompile.evaluation import store
from kvcompile.evaluation.contestants import FULL
from kvcompile.evaluation.report import summary_table
from kvcompile.evaluation.store import BUNDLING, read_saved_records, read_saved_settings
from kvcompile.markdown import markdown_code, markdown_text
from kvruntime import KVRuntimeError
from kvruntime.artifacts.bundle import results_problem
from kvruntime.errors import printable

NUMBER = ((int, float), "a number")
RECORD_KEYS = {  # a resumable record's keys, and the measures the table reads
    **store.RECORD_KEYS,
    "correct": NUMBER,
    "kl": NUMBER,
    "answer_kl": NUMBER,
    "answer_logprob": NUMBER,
    "agreement": NUMBER,
    "cache_kept": NUMBER,
}
TABLE_COLUMNS = ("method", "ratio", "accuracy", "answer_kl", "answer_logprob", "cache_kept")
PICTURE = "accuracy_vs_ratio.png"  # the eval's plot, carried as `eval_` + its name
PICTURE_MAX_BYTES = 8 * 2**20
_COMMAND = re.compile(r"^Command: `(kvcompile eval [^`]*)`", re.MULTILINE)


def eval_results(folder: Path) -> dict[str, Any]:
    """The manifest's `results` object from an eval run's `folder`; one line saying why not."""
    if not folder.is_dir():
        raise KVRuntimeError(f"--results {folder}: not a folder (give the --out folder of a kvcompile eval run)")
    settings = read_saved_settings(folder / "run.json", BUNDLING)
    records = read_saved_records(folder / "runs.jsonl", BUNDLING, RECORD_KEYS)
    if not any(r["method"] == FULL for r in records) or not all(
        math.isfinite(r[key]) for r in records for key in RECORD_KEYS if key not in ("prompt", "method")
    ):
        raise KVRuntimeError(f"--results {folder}: its records hold no full cache's, or a number that is not finite")
    table = [{key: row[key] for key in TABLE_COLUMNS} for row in summary_table(records)]
    report = folder / "results.md"
    found = _COMMAND.search(report.read_text(encoding="utf-8", errors="replace")) if report.is_file() else None
    command = found.group(1) if found and found.group(1).isprintable() else None
    results = {
        "source": printable(prompts_source(settings)),
        "prompts": len({r["prompt"] for r in records}),
        "question_aware": bool(settings.get("question_aware")),
        "command": command,
        "table": table,
    }
    picture = folder / PICTURE
    if picture.is_file() and not picture.is_symlink() and picture.stat().st_size <= PICTURE_MAX_BYTES:
        results["picture"] = "eval_" + PICTURE
    problem = results_problem(results)  # what a bundle's reader would refuse (a method name that is not text)
    if problem:
        raise KVRuntimeError(f"--results {folder}: {problem}; give the --out folder of a kvcompile eval run")
    return results


def prompts_source(settings: dict[str, Any]) -> str:
    """Where a run's prompts came from, from its saved settings: a user's suite or the built-in tasks."""
    if settings.get("suite") is not None:
        name = Path(str(settings["suite"])).name
        return (
            f"the suite {name} (sha256 {str(settings.get('suite_sha256'))[:12]}), scored by {settings.get('scoring')}"
        )
    tasks = settings.get("tasks") if isinstance(settings.get("tasks"), list) else []
    lengths = settings.get("lengths") if isinstance(settings.get("lengths"), list) else []
    return (
        f"kvcompile's suite: tasks {', '.join(map(str, tasks))}; lengths {', '.join(map(str, lengths))}; "
        f"seed {settings.get('seed')}"
    )


def results_lines(
    results: dict[str, Any],
    text: Callable[[object], str] = markdown_text,
    code: Callable[[object], str] = markdown_code,
) -> list[str]:
    """The carried results as the model card's markdown (`text` and `code` escape what the records hold; `printable`
    for a terminal): where the prompts came from, the table, the plot."""
    asked = "question-aware" if results["question_aware"] else "question-agnostic"
    lines = [
        f"`kvcompile eval` on {results['prompts']} prompts of {text(results['source'])}, {asked}; equal ratios are equal "
        "bytes removed as measured (`cache_kept`: the bytes held over the full cache's). `answer_kl`: the KL from the "
        "full cache over its answer's tokens; `answer_logprob`: the expected answer's log-probability.",
        "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "| --- |" + " --- |" * (len(TABLE_COLUMNS) - 1),
    ]
    lines += ["| " + " | ".join(_cell(row.get(c), text) for c in TABLE_COLUMNS) + " |" for row in results["table"]]
    if results.get("command"):
        lines += ["", f"Rerun: {code(results['command'])}"]
    if results.get("picture"):
        lines += ["", f"![accuracy against the bytes removed]({text(results['picture'])})"]
    return [*lines, ""]


def _cell(value: object, text: Callable[[object], str]) -> str:
    return f"{value:.4g}" if isinstance(value, float) else text(value)
