"""The settings of `distilled`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses

from kvruntime import KVRuntimeError
from kvruntime.methods.distilled.oracle import ORACLES, STUDENTS

HELD_OUT_EVERY = 4  # prompts 3, 7, 11, ... choose the ridge strength


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    prompts: int = 32  # calibration prompts (every 4th held out to choose the ridge strength)
    prompt_tokens: int = 2048  # tokens per calibration prompt
    oracle: str = "reconstruction"  # the second pass distilled (ORACLES)
    student: str = "all"  # the features it reads: all, or KVzap's hidden state and bias (STUDENTS)
    seed: int = 0

    def check(self) -> None:
        if self.oracle not in ORACLES:
            raise KVRuntimeError(f"--oracle {self.oracle!r}: use one of {', '.join(ORACLES)}")
        if self.student not in STUDENTS:
            raise KVRuntimeError(f"--student {self.student!r}: use one of {', '.join(STUDENTS)}")
        if self.prompts < HELD_OUT_EVERY:
            raise KVRuntimeError(f"--prompts must be at least {HELD_OUT_EVERY} (every {HELD_OUT_EVERY}th is held out)")
        if self.prompt_tokens < 64:
            raise KVRuntimeError("--prompt-tokens must be at least 64")
