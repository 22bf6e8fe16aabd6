"""Pictures without a display (matplotlib's Agg backend), saved one way: every picture module imports `plt` here."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

__all__ = ["plt", "save_figure"]


def save_figure(figure: object, path: Path, dpi: int = 110) -> str:
    """Write the figure as a PNG, free it, and say where it went."""
    figure.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(figure)
    return f"wrote {path}"
