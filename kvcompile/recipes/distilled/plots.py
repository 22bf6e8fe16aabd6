"""Picture of a distilled scorer: per layer, how much of the held-out oracle's variance it explains."""

from __future__ import annotations

from pathlib import Path

from kvcompile.plotting import plt, save_figure
from kvruntime import Artifact


def plot_distilled_scorer(artifact: Artifact, path: Path) -> str:
    r2, alphas = artifact.tensors["held_out_r2"], artifact.params["alphas"]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(range(r2.shape[0]), r2.max(dim=1).values.numpy())
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("held-out R^2 of the log-scores")
    axes[0].set_title(f"fit per layer (oracle: {artifact.params['oracle']})")
    image = axes[1].imshow(r2.numpy(), aspect="auto", origin="lower", cmap="viridis")
    axes[1].set_xticks(range(len(alphas)), [f"{a:g}" for a in alphas])
    axes[1].set_xlabel("ridge strength (relative)")
    axes[1].set_ylabel("layer")
    axes[1].set_title("held-out R^2 per ridge strength")
    figure.colorbar(image, ax=axes[1], shrink=0.8)
    figure.tight_layout()
    return save_figure(figure, path)
