"""Why kvcompose's compiled mode answers fewer retrieval questions than the dynamic mode: the share of the answer's
tokens each keeps, and how far the compiled layer allocation is from the one the dynamic mode computes on the
same prompt (so that the loss can be put on the token scores or on the allocation).

    python -m benchmarks.kvcompose.coverage [--depths 0.1,0.5,0.9] [--ratios 0.5,0.75,0.9] [--out benchmarks/kvcompose/kvcompose_coverage.md]

A third variant scores with the dynamic mode's two passes but allocates with the compiled shares.
Held-out prompts of the comparison (2,048 tokens, question-agnostic: the context alone is compressed). Coverage =
kept answer tokens / answer tokens, averaged over layers and KV heads. Allocation gap = sum over layers of
|compiled slots - dynamic slots| / (2 x kept entries): the share of the kept cache placed in other layers.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from pathlib import Path

import kvruntime
from benchmarks.coverage import coverage, coverage_sessions, ratio_coverage_arguments
from benchmarks.reporting import run_header, write_results
from kvcompile.recipe import default_artifact
from kvcompile.tasks.retrieval import TASKS
from kvruntime.math.composite_tokens import kv_head_scores
from kvruntime.methods import KVCompose
from kvruntime.methods.kvcompose import KVComposeStats

STATS = default_artifact("default", "kvcompose_stats")
HYBRID = "two-pass scores, compiled allocation"
MODES = ("compiled", "dynamic", HYBRID)


@dataclasses.dataclass
class TwoPassScoresCompiledAllocation(KVCompose):
    """The dynamic mode's token scores with the compiled mode's layer allocation: separates the two causes."""

    @property
    def budgets_known_in_advance(self) -> bool:
        return False  # the two-pass scores exist only after the prefill: no per-layer cut inside it

    def select(self, statistics, plan, prefill):
        scores = [kv_head_scores(task_max, prefill.num_kv_heads) for task_max in prefill.second_pass_attention()]
        return super().select(scores, plan, prefill)


def method_for(mode: str, stats: KVComposeStats):
    if mode == HYBRID:
        return TwoPassScoresCompiledAllocation(stats=stats)
    return KVCompose(mode=mode, stats=stats)


def main() -> None:
    args = ratio_coverage_arguments(__doc__.splitlines()[0], "benchmarks/kvcompose/kvcompose_coverage.md")
    ratios = args.ratios
    model, tokenizer = kvruntime.load_model()
    stats = KVComposeStats.from_artifact(kvruntime.load_artifact(STATS, model=model))
    rows, slots = [], {}
    modes = {mode: method_for(mode, stats) for mode in MODES}
    for prompt, ratio, mode, session, span in coverage_sessions(model, tokenizer, args, modes):
        slots[mode] = session.report.slots_per_layer
        rows.append(
            dict(
                task=prompt.task,
                depth=prompt.depth,
                ratio=ratio,
                mode=mode,
                coverage=round(coverage(session.kept_positions, span), 4),
            )
        )
        if mode == MODES[-1]:  # every mode of this prompt and ratio has run
            gap = sum(abs(a - b) for a, b in zip(slots["compiled"], slots["dynamic"])) / (2 * sum(slots["dynamic"]))
            for row in rows[-len(MODES) :]:
                row["allocation_gap"] = round(gap, 4)
    write_results(rows, Path(args.out), render(rows, ratios))


def render(rows: list[dict], ratios: list[float]) -> str:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["ratio"], r["mode"])].append(r)
    lines = [
        "# KVCompose: answer-token coverage, compiled against dynamic (default model)",
        "",
        *run_header(),
        f"Coverage: mean over the "
        f"{len({r['depth'] for r in rows})} prompts (depths) of each task; allocation gap: mean over all prompts.",
        "",
        "| ratio | mode | " + " | ".join(f"coverage, {t}" for t in TASKS) + " | allocation gap |",
        "|---|---|" + "---|" * (len(TASKS) + 1),
    ]
    for ratio in ratios:
        for mode in MODES:
            cell = cells[(ratio, mode)]
            per_task = " | ".join(
                f"{statistics.mean(r['coverage'] for r in cell if r['task'] == t):.2f}" for t in TASKS
            )
            gap = statistics.mean(r["allocation_gap"] for r in cell)
            lines.append(f"| {ratio} | {mode} | {per_task} | {gap:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
