"""Pictures of compiled artifacts (PNG), for the README and for a quick look after a compile run."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvruntime.allocation import error_aware_budgets  # noqa: E402
from kvruntime.artifact import Artifact  # noqa: E402


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
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


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
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


def plot_compilerkv_tables(artifact: Artifact, path: Path) -> str:
    """W_head per budget (layer x head), T_gate per budget over (entropy bin, perplexity bin) averaged over layers
    (dots: cells with calibration prompts of their own), and the CQL learning curves."""
    tensors = artifact.tensors
    budgets = tensors["budgets"].tolist()
    columns = max(len(budgets), 2)
    figure, axes = plt.subplots(3, columns, figsize=(3.8 * columns, 11), squeeze=False, layout="constrained")
    for index, budget in enumerate(budgets):
        axis = axes[0][index]
        image = axis.imshow(tensors["head_reliability"][index].numpy(), aspect="auto", cmap="coolwarm", vmin=0.8, vmax=1.5, origin="lower")
        axis.set_title(f"W_head, B={budget}")
        axis.set_xlabel("query head")
        axis.set_ylabel("layer")
        axis = axes[1][index]
        gate = axis.imshow(tensors["risk_thresholds"][index].mean(dim=0).numpy(), aspect="auto", cmap="viridis", vmin=0.8, vmax=1.0, origin="lower")
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
    for axis in axes[0][len(budgets):].tolist() + axes[1][len(budgets):].tolist():
        axis.axis("off")
    figure.suptitle(f"CompilerKV tables, {artifact.model.architecture}")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"wrote {path}"


def plot_kvcompose_stats(artifact: Artifact, path: Path, shown: tuple[float, ...] = (0.5, 0.75, 0.9)) -> str:
    """The layer allocation versus target ratio (heat map, and bars with the spread over calibration prompts for a
    few ratios), the composite-token curves, and each (layer, KV head)'s score at the top 1% rank."""
    t = artifact.tensors
    ratios, fractions, spread = t["ratios"].tolist(), t["layer_fractions"], t["layer_fraction_std"]
    layers = fractions.shape[1]
    figure, axes = plt.subplots(2, 2, figsize=(13, 9), layout="constrained")
    axis = axes[0][0]
    image = axis.imshow(fractions.T.numpy(), aspect="auto", cmap="viridis", origin="lower", vmin=0, vmax=1)
    axis.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
    axis.set_xlabel("target compression ratio")
    axis.set_ylabel("layer")
    axis.set_title("share of the context each layer keeps")
    figure.colorbar(image, ax=axis, shrink=0.8)
    axis = axes[0][1]
    chosen = [i for i, r in enumerate(ratios) if any(abs(r - s) < 1e-6 for s in shown)]
    width = 0.8 / max(len(chosen), 1)
    for offset, index in enumerate(chosen):
        axis.bar([x + offset * width for x in range(layers)], fractions[index].numpy(), width,
                 yerr=spread[index].numpy(), capsize=1, label=f"ratio {ratios[index]:g} (mean {1 - ratios[index]:.2f})")
    axis.set_xlabel("layer")
    axis.set_ylabel("share kept (error bar: std over prompts)")
    axis.set_title("allocation for a few ratios")
    axis.legend()
    axis = axes[1][0]
    quantiles = t["rank_quantiles"].numpy()
    colours = plt.cm.plasma([i / max(layers - 1, 1) for i in range(layers)])
    for layer in range(layers):
        axis.plot(quantiles[1:], t["composite_curves"][layer, 1:].numpy(), color=colours[layer], linewidth=1)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("composite token rank (share of the context)")
    axis.set_ylabel("composite score")
    axis.set_title("composite-token curves (dark: first layers, light: last)")
    axis = axes[1][1]
    top = int((t["rank_quantiles"] - 0.01).abs().argmin())
    image = axis.imshow(t["head_score_quantiles"][:, :, top].numpy(), aspect="auto", cmap="magma", origin="lower")
    axis.set_xticks(range(t["head_score_quantiles"].shape[1]))
    axis.set_xlabel("KV head")
    axis.set_ylabel("layer")
    axis.set_title("score at rank 1% per (layer, KV head)")
    figure.colorbar(image, ax=axis, shrink=0.8)
    figure.suptitle(f"KVCompose statistics, {artifact.model.architecture} ({artifact.params.get('task_mode')})")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"wrote {path}"


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
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"
