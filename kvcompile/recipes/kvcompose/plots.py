"""Picture of KVCompose's attention statistics."""

from __future__ import annotations

from pathlib import Path

from kvcompile.plotting import plt, save_figure
from kvruntime import Artifact


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
        axis.bar(
            [x + offset * width for x in range(layers)],
            fractions[index].numpy(),
            width,
            yerr=spread[index].numpy(),
            capsize=1,
            label=f"ratio {ratios[index]:g} (mean {1 - ratios[index]:.2f})",
        )
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
    return save_figure(figure, path, dpi=100)
