"""Pictures without a display (matplotlib's Agg backend), saved one way: every picture module imports `plt` here."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from kvruntime.files import write_atomically

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

__all__ = ["plt", "save_figure"]


def save_figure(figure: object, path: Path, dpi: int = 110) -> str:
    """Write the figure as a PNG (atomically, like every output), free it, and say where it went."""
    try:
        write_atomically(path, lambda tmp_name: figure.savefig(tmp_name, format="png", dpi=dpi, bbox_inches="tight"))
    finally:
        plt.close(figure)
    return f"wrote {path}"
