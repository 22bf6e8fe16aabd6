"""Pictures of CompressKV's artifacts: head scores, and the layer budgets they give at a few ratios."""

from __future__ import annotations

from pathlib import Path

from kvcompile.plotting import plt, save_figure
from kvruntime import Artifact
from kvruntime.math.allocation import error_aware_budgets


def plot_head_scores(artifact: Artifact, path: Path) -> str:
    figure, axes = plt.subplots(1, 2, figsize=(9, 7), sharey=True)
    for axis, name, title in zip(
        axes, ("srh_score", "retrieval_score"), ("Semantic Retrieval Head score", "classic retrieval-head score")
    ):
        image = axis.imshow(artifact.tensors[name].numpy(), aspect="auto", cmap="viridis", origin="lower")
        axis.set_title(title)
        axis.set_xlabel("query head")
        figure.colorbar(image, ax=axis, shrink=0.8)
    axes[0].set_ylabel("layer")
    figure.suptitle(f"{artifact.model.architecture}: {int(artifact.tensors['successful_probes'])} answered probes")
    figure.tight_layout()
    return save_figure(figure, path)


def plot_layer_budgets(
    artifact: Artifact, path: Path, context: int = 2048, ratios: tuple[float, ...] = (0.5, 0.75, 0.9)
) -> str:
    errors = artifact.tensors["layer_error"].tolist()
    layers = range(len(errors))
    figure, axis = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(ratios)
    for offset, ratio in enumerate(ratios):
        budget = round((1 - ratio) * context)
        allocation = error_aware_budgets(errors, budget)
        axis.bar([x + offset * width for x in layers], allocation, width, label=f"ratio {ratio} (mean {budget})")
    axis.set_xlabel("layer")
    axis.set_ylabel(f"tokens kept (of a {context}-token prompt)")
    axis.set_title("Error-aware layer budgets (CompressKV Algorithm 1)")
    axis.legend()
    figure.tight_layout()
    return save_figure(figure, path)
