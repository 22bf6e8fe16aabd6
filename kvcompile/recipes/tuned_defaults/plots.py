"""Picture of a tuning run: accuracy versus ratio per method, and the recommendation."""

from __future__ import annotations

from pathlib import Path

from kvcompile.plotting import plt, save_figure
from kvruntime import Artifact


def plot_tuned_defaults(artifact: Artifact, path: Path) -> str:
    """Validation accuracy versus ratio per tuned method, the full cache's accuracy and the tolerance band."""
    t, params = artifact.tensors, artifact.params
    ratios = t["ratios"].tolist()
    full, tolerance = float(t["full_accuracy"][0]), float(params["tolerance"])
    figure, axis = plt.subplots(figsize=(7, 4.2))
    axis.axhspan(full - tolerance, full, color="green", alpha=0.15, label=f"within {tolerance} of the full cache")
    axis.axhline(full, color="green", linewidth=1)
    for m, label in enumerate(params["methods"]):
        points = [(r, a) for r, a in zip(ratios, t["accuracy"][m].tolist()) if a >= 0]
        if points:
            axis.plot(*zip(*points), marker="o", label=label)
    recommended = params["recommended"]
    if recommended:
        axis.plot([recommended["ratio"]], [recommended["accuracy"]], "k*", markersize=14, label="recommended")
    axis.set_xlabel("compression ratio")
    axis.set_ylabel("validation accuracy")
    axis.set_ylim(-0.05, 1.05)
    axis.legend(fontsize=8)
    axis.set_title(f"kvcompile tune: {artifact.model.architecture}")
    figure.tight_layout()
    return save_figure(figure, path)
