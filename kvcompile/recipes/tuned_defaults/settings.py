"""The settings of `tuned_defaults`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses

from kvcompile.evaluation.settings import SuiteSettings
from kvruntime import KVRuntimeError


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    suite: SuiteSettings  # the validation prompts and the ratios tried, in increasing order
    tolerance: float = 0.02  # the largest accuracy loss against the full cache accepted (0.02 = 2 points)

    def check(self) -> None:
        self.suite.check()
        if not 0.0 <= self.tolerance < 1.0:
            raise KVRuntimeError(f"--tolerance {self.tolerance}: give an accuracy difference in [0, 1)")
