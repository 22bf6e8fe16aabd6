"""Where the shipped folders are: `artifacts/` (compiled artifacts of the default model) and `calibration_data/`
(corpora, prompts, task sets). Beside the package in a source checkout or an editable install; inside the package
(`kvcompile/_shipped/`, see pyproject's package-dir) when installed from a wheel."""

from __future__ import annotations

from pathlib import Path

from kvruntime import KVRuntimeError

SHIPPED_FOLDERS = ("artifacts", "calibration_data")
_PACKAGE = Path(__file__).resolve().parent


def shipped_folder(name: str) -> Path:
    """The shipped folder `name` (one of SHIPPED_FOLDERS)."""
    places = (_PACKAGE.parent / name, _PACKAGE / "_shipped" / name)
    for place in places:
        if place.is_dir():
            return place
    raise KVRuntimeError(
        f"the shipped {name}/ folder is missing (looked in {places[0]} and {places[1]}): reinstall kvcompile"
    )
