"""How close `kvcompile compile`'s time estimate comes (issue #75): each shipped model's forwards timed by the same
probe (`kvcompile.calibration.forward_costs`), each compile command's estimate at the settings its shipped artifact
was compiled with (the commands in `artifacts/<model>/*.run.json`), against the wall time that run recorded
(`compile_seconds`, 2-core VMs like this one), and the estimate at the defaults `compile` runs.

    python -m benchmarks.performance.compile_estimate [--out benchmarks/performance/compile_estimate.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kvruntime
from benchmarks.reporting import command_line, machine, markdown_table, write_results
from kvcompile.calibration.forward_probe import measure_forward_costs
from kvcompile.recipe import artifact_folder
from kvcompile.recipes.compilerkv.settings import DESIGNS, TablesSettings
from kvcompile.recipes.compresskv.settings import HeadsSettings, LayerErrorsSettings
from kvcompile.recipes.distilled.settings import DistillSettings
from kvcompile.recipes.kvcompose.settings import StatsSettings

# The settings of each shipped artifact's recorded command (its defaults but what the command line names).
SHIPPED_TABLES = TablesSettings(
    design=DESIGNS["every-state"], loss="kl", continuation_from="greedy", budgets=(256,), prompts=16, rounds=1,
    entropy_bins=1, perplexity_bins=1,
)  # fmt: skip
SHIPPED = {
    "default": {
        "srh_heads": HeadsSettings(),
        "layer_budgets": LayerErrorsSettings(),
        "kvcompose_stats": StatsSettings(),
        "distilled_scorer": DistillSettings(lookahead_queries=16, lookahead_held_out=0),  # compiled before both
        "compilerkv_tables": SHIPPED_TABLES,
    },
    "gemma-3-270m": {
        "srh_heads": HeadsSettings(chat=False),
        "layer_budgets": LayerErrorsSettings(),
        "kvcompose_stats": StatsSettings(),
        "distilled_scorer": DistillSettings(lookahead_queries=8),
        "compilerkv_tables": SHIPPED_TABLES,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/performance/compile_estimate.md"))
    args = parser.parse_args()
    rows = []
    for name, kinds in SHIPPED.items():
        model, _ = kvruntime.load_model(name)
        costs, shape = measure_forward_costs(model), kvruntime.model_fingerprint(model)
        for kind, settings in kinds.items():
            recorded = json.loads((artifact_folder(name) / f"{kind}.run.json").read_text())["compile_seconds"]
            estimated = settings.estimated_seconds(costs, shape)
            default = type(settings)().estimated_seconds(costs, shape)
            rows.append({"model": name, "artifact": kind, "estimated_s": round(estimated), "recorded_s": round(recorded),
                         "recorded_over_estimate": round(recorded / estimated, 2), "at_defaults_s": round(default)})  # fmt: skip
        total = [row for row in rows if row["model"] == name]
        estimated, recorded = (sum(row[key] for row in total) for key in ("estimated_s", "recorded_s"))
        rows.append({"model": name, "artifact": "all five", "estimated_s": estimated, "recorded_s": recorded,
                     "recorded_over_estimate": round(recorded / estimated, 2),
                     "at_defaults_s": sum(row["at_defaults_s"] for row in total)})  # fmt: skip
    header = [
        "# `kvcompile compile`'s estimate against the shipped artifacts' recorded compile times",
        "",
        f"Command: `{command_line()}`. Machine: {machine()}. The recorded times come from the run records beside "
        "the shipped artifacts (other 2-core VMs); `at_defaults_s` is the estimate at each command's defaults, what "
        "`kvcompile compile` runs.",
        "",
    ]
    write_results(rows, args.out, "\n".join([*header, *markdown_table(rows), ""]))


if __name__ == "__main__":
    main()
