"""Pictures of an evaluation run: accuracy versus ratio per task, and needle-in-a-haystack heatmaps."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from kvcompile.evaluation.contestants import FULL
from kvcompile.evaluation.metrics import grouped
from kvcompile.plotting import plt, save_figure


def plot_accuracy_vs_ratio(records: list[dict], path: Path) -> None:
    """One panel per task and one for all tasks; a line per method, starting from the full cache. The x axis is the
    share of the full cache's bytes each method actually removed (measured, mean over prompts), not the nominal
    ratio: methods that hold more or less than asked are compared at the bytes they really hold."""
    tasks = [*dict.fromkeys(r["task"] for r in records), "all tasks"]
    methods = [m for m in dict.fromkeys(r["method"] for r in records) if m != FULL]
    columns = min(4, len(tasks))
    rows = -(-len(tasks) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.3 * rows), squeeze=False, sharey=True)
    for axis, task in zip(axes.flat, tasks):
        chosen = records if task == "all tasks" else [r for r in records if r["task"] == task]
        groups = grouped(chosen, lambda r: (r["method"], r["ratio"]))
        accuracy = {k: statistics.mean(r["correct"] for r in v) for k, v in groups.items()}
        removed = {k: 1.0 - statistics.mean(r["cache_kept"] for r in v) for k, v in groups.items()}
        full = accuracy[(FULL, 0.0)]
        for index, method in enumerate(methods):
            ratios = sorted(r for m, r in accuracy if m == method)
            style = "-" if not method.startswith("kvpress") else "--"
            axis.plot(
                [0.0, *(removed[(method, r)] for r in ratios)],
                [full, *(accuracy[(method, r)] for r in ratios)],
                style,
                marker="o",
                markersize=3,
                label=method,
                color=plt.cm.tab20(index % 20),
            )
        axis.set_title(task)
        axis.set_xlabel("share of the cache's bytes removed")
        axis.set_ylim(-0.05, 1.05)
    for axis in axes.flat[len(tasks) :]:
        axis.axis("off")
    for axis in axes[:, 0]:
        axis.set_ylabel("accuracy")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    # Below the panels, never over one (a full grid has no empty panel to hold it).
    legend_columns = min(5, len(methods))
    legend_height = (0.25 * -(-len(methods) // legend_columns) + 0.15) / (3.3 * rows)
    figure.legend(handles, labels, loc="lower center", fontsize=8, ncol=legend_columns, frameon=False)
    figure.suptitle("Accuracy versus the cache's bytes really removed (solid: kvcompile, dashed: kvpress)")
    figure.tight_layout(rect=(0, legend_height, 1, 1))
    save_figure(figure, path, dpi=100)


def plot_niah_heatmap(records: list[dict], path: Path) -> None:
    """Accuracy of the tasks with a depth (needles, pass key, questions), by depth (rounded to 0.1) and context
    length: a row of panels per ratio, a column per method (the full cache in the first column)."""
    placed = [r for r in records if r["depth"] is not None]
    if not placed:
        return
    depths = sorted({round(r["depth"], 1) for r in placed})
    lengths = sorted({r["length"] for r in placed})
    methods = list(dict.fromkeys(r["method"] for r in placed))
    ratios = sorted({r["ratio"] for r in placed if r["method"] != FULL})
    cells = grouped(
        placed, lambda r: (r["method"], 0.0 if r["method"] == FULL else r["ratio"], r["length"], round(r["depth"], 1))
    )
    figure, axes = plt.subplots(
        len(ratios), len(methods), figsize=(1.6 * len(methods) + 1, 1.9 * len(ratios) + 0.8), squeeze=False, sharey=True
    )
    for row, ratio in enumerate(ratios):
        for column, method in enumerate(methods):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for i, depth in enumerate(depths):
                for j, length in enumerate(lengths):
                    cell = cells.get((method, 0.0 if method == FULL else ratio, length, depth))
                    if cell:
                        grid[i, j] = statistics.mean(r["correct"] for r in cell)
            axis = axes[row, column]
            image = axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            axis.set_xticks(
                range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths], fontsize=7
            )
            axis.set_yticks(range(len(depths)), [f"{d:.1f}" for d in depths], fontsize=7)
            if row == 0:
                axis.set_title(method, fontsize=7)
            if column == 0:
                axis.set_ylabel(f"ratio {ratio}\ndepth", fontsize=8)
    figure.colorbar(image, ax=axes, shrink=0.6, label="accuracy")
    figure.suptitle("Needle in a haystack: accuracy by depth (rows) and context length (columns)")
    save_figure(figure, path, dpi=100)
