"""Picture of CompilerKV's tables and how they were learned."""

from __future__ import annotations

from pathlib import Path

from kvcompile.plotting import plt, save_figure
from kvruntime import Artifact


def plot_compilerkv_tables(artifact: Artifact, path: Path) -> str:
    """W_head per budget (layer x head), T_gate per budget over (entropy bin, perplexity bin) averaged over layers
    (dots: cells with calibration prompts of their own), and the CQL learning curves."""
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
        gate = axis.imshow(
            tensors["risk_thresholds"][index].mean(dim=0).numpy(),
            aspect="auto",
            cmap="viridis",
            vmin=0.8,
            vmax=1.0,
            origin="lower",
        )
        seen = tensors["gate_support"][index].sum(dim=0).nonzero()
        axis.scatter(seen[:, 1], seen[:, 0], s=8, c="white", marker="o")
        axis.set_title(f"T_gate over layers, B={budget}")
        axis.set_xlabel("perplexity bin")
        axis.set_ylabel("entropy bin")
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="head weight")
    figure.colorbar(gate, ax=axes[1].tolist(), shrink=0.8, label="threshold")
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
