"""How an artifact was made: recorded in its metadata."""

from __future__ import annotations

import datetime
import sys

from kvcompile import __version__
from kvcompile.calibration.corpus import Corpus


def provenance(corpus: Corpus, seed: int, **settings: object) -> dict:
    return {
        "command": " ".join(["kvcompile", *sys.argv[1:]]),
        "calibration_data": corpus.name,
        "calibration_sha256": corpus.sha256,
        "seed": seed,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kvcompile_version": __version__,
        **settings,
    }
