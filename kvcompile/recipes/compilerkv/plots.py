"""Picture of CompilerKV's tables and how they were learned."""

from __future__ import annotations

from pathlib import Path

from kvcompile.plotting import plt, save_figure
from kvruntime import Artifact


def plot_compilerkv_tables(artifact: Artifact, path: Path) -> str:
    """W_head per budget (layer x head), T_gate per budget and layer (mean and range over the risk cells), and the
    CQL learning curves."""
    tensors = artifact.tensors
    budgets = tensors["budgets"].tolist()
    columns = max(len(budgets), 2)
    figure, axes = plt.subplots(3, columns, figsize=(3.8 * columns, 11), squeeze=False, layout="constrained")
    for index, budget in enumerate(budgets):
        axis = axes[0][index]
        image = axis.imshow(
            tensors["head_reliability"][index].numpy(),
            aspect="auto",
            cmap="coolwarm",
            vmin=0.8,
            vmax=1.5,
            origin="lower",
        )
        axis.set_title(f"W_head, B={budget}")
        axis.set_xlabel("query head")
        axis.set_ylabel("layer")
        axis = axes[1][index]
        thresholds = tensors["risk_thresholds"][index].flatten(1)  # [layers, risk cells]
        layers = range(len(thresholds))
        axis.plot(layers, thresholds.mean(dim=1).tolist(), marker="o", label="mean over risk cells")
        if thresholds.shape[1] > 1:
            low, high = thresholds.min(dim=1).values.tolist(), thresholds.max(dim=1).values.tolist()
            axis.fill_between(layers, low, high, alpha=0.25, label="range over risk cells")
            axis.legend(fontsize="small")
        axis.set_ylim(0.79, 1.01)
        axis.set_title(f"T_gate per layer, B={budget}")
        axis.set_xlabel("layer")
        axis.set_ylabel("threshold")
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="head weight")
    for axis, name in zip(axes[2][:2], ("head", "gate")):
        for round_, curve in enumerate(tensors[f"{name}_learning_curve"].tolist()):
            axis.plot(range(1, len(curve) + 1), curve, marker=".", label=f"fit {round_ + 1}")
        axis.set_title(f"CQL loss, {name} table")
        axis.set_xlabel("epoch")
        axis.legend()
    changes = tensors["round_changes"]
    if columns > 2 and len(changes):
        axis = axes[2][2]
        for column, name in enumerate(("W_head", "T_gate")):
            axis.plot(range(1, len(changes) + 1), changes[:, column].tolist(), marker="o", label=name)
        axis.set_ylim(0, 1)
        axis.set_title("entries changed per round")
        axis.set_xlabel("round")
        axis.legend()
    for axis in axes[2][3:]:
        axis.axis("off")
    for axis in axes[0][len(budgets) :].tolist() + axes[1][len(budgets) :].tolist():
        axis.axis("off")
    figure.suptitle(f"CompilerKV tables, {artifact.model.architecture}")
    return save_figure(figure, path, dpi=100)
