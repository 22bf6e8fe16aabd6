"""How an artifact was made, recorded in its metadata: the calibration data and its hash, the seed, the library
versions and the recipe's own settings; `compile_artifact` adds the command that reruns it. Nothing that changes
from run to run (date, wall time, output path) goes here: those go to the run record beside the artifact, so the
same command gives the same bytes."""

from __future__ import annotations

import importlib.metadata

from kvcompile import __version__
from kvcompile.calibration.corpus import Corpus

RECORDED_LIBRARIES = ("kvruntime", "torch", "transformers", "safetensors", "numpy", "scipy", "d3rlpy")


def provenance(corpus: Corpus, seed: int, **settings: object) -> dict:
    return {
        "calibration_data": corpus.name,
        "calibration_sha256": corpus.sha256,
        "seed": seed,
        "kvcompile_version": __version__,
        "libraries": library_versions(),
        **settings,
    }


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries a compile's numbers depend on."""
    versions = {}
    for name in RECORDED_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
