"""Where `distilled` loses answers its teacher keeps: the share of the answer's tokens each keeps, with two hybrids
that put the loss on the token scores or on the layer shares.

    python -m benchmarks.distilled.coverage [--depths 0.1,0.5,0.9] [--ratios 0.5,0.75,0.9]

Methods: `distilled` (the student's scores, its dynamic allocation with the floor), `distilled:allocation=uniform`,
the teacher `kvcompose:mode=dynamic` (two-pass scores, their own global pool), the teacher's scores with the
student's allocation rule, and the student's scores with the teacher's layer shares on the same prompt. Held-out
prompts (Moby-Dick haystack and RULER-like filler for the pass key, 2,048 tokens), question-agnostic: the context
alone is compressed. Coverage = kept answer tokens / answer tokens, averaged over layers and KV heads.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from pathlib import Path

import torch

import kvruntime
from benchmarks.coverage import coverage, coverage_sessions, ratio_coverage_arguments
from benchmarks.reporting import markdown_table, run_header, write_results
from kvcompile.recipe import default_artifact
from kvcompile.tasks.retrieval import TASKS
from kvruntime.math.composite_tokens import kv_head_scores, prompt_allocation
from kvruntime.math.selection import protect_window
from kvruntime.methods import Distilled, KVCompose, Selection
from kvruntime.methods.distilled import DistilledScorer

SCORER = default_artifact("default", "distilled_scorer")
TEACHER_SCORES, TEACHER_SHARES = "teacher's scores, student's allocation", "student's scores, teacher's shares"


def teacher_scores(prefill) -> list[torch.Tensor]:
    """The second pass's scores [1, Hkv, N] per layer: what `kvcompose:mode=dynamic` ranks by."""
    return [kv_head_scores(task_max, prefill.num_kv_heads) for task_max in prefill.second_pass_attention()]


@dataclasses.dataclass
class TeacherScoresStudentAllocation(Distilled):
    def select(self, statistics, plan, prefill):
        window = min(self.window, statistics[0].shape[-1])
        logs = [protect_window(s.clamp_min(1e-30).log(), window) for s in teacher_scores(prefill)]
        return super().select(logs, plan, prefill)


@dataclasses.dataclass
class StudentScoresTeacherShares(Distilled):
    def select(self, statistics, plan, prefill):
        counts = prompt_allocation(torch.stack([s[0] for s in teacher_scores(prefill)]), plan.keep, per_head=False)
        num_kv_heads = statistics[0].shape[1]
        return Selection(statistics, counts[:, None].expand(-1, num_kv_heads).clone(), [])


def methods(scorer: DistilledScorer) -> dict[str, kvruntime.Method]:
    return {
        "distilled": Distilled(scorer=scorer),
        "distilled:allocation=uniform": Distilled(scorer=scorer, allocation="uniform"),
        "kvcompose:mode=dynamic (teacher)": KVCompose(mode="dynamic"),
        TEACHER_SCORES: TeacherScoresStudentAllocation(scorer=scorer),
        TEACHER_SHARES: StudentScoresTeacherShares(scorer=scorer),
    }


def main() -> None:
    args = ratio_coverage_arguments(__doc__.splitlines()[0], "benchmarks/distilled/distilled_coverage.md")
    ratios = args.ratios
    model, tokenizer = kvruntime.load_model()
    scorer = DistilledScorer.from_artifact(kvruntime.load_artifact(SCORER, model=model))
    rows = [
        dict(
            task=prompt.task,
            depth=prompt.depth,
            ratio=ratio,
            method=label,
            coverage=round(coverage(session.kept_positions, span), 4),
            entries_removed=round(session.report.entries_removed_fraction, 4),
        )
        for prompt, ratio, label, session, span in coverage_sessions(model, tokenizer, args, methods(scorer))
    ]
    write_results(rows, Path(args.out), render(rows, ratios))


def render(rows: list[dict], ratios: list[float]) -> str:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["ratio"], r["method"])].append(r)
    table = [
        {
            "ratio": ratio,
            "method": label,
            **{
                f"coverage, {t}": f"{statistics.mean(r['coverage'] for r in cell if r['task'] == t):.2f}" for t in TASKS
            },
            "entries removed": f"{statistics.mean(r['entries_removed'] for r in cell):.3f}",
        }
        for (ratio, label), cell in cells.items()
    ]
    lines = [
        "# Distilled against its teacher: answer-token coverage (default model)",
        "",
        *run_header(),
        f"Coverage: mean over the {len({r['depth'] for r in rows})} prompts (depths) of each task, question-agnostic.",
        "",
        *markdown_table(table),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
