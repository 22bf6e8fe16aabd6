"""The settings of `distilled`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses

from kvruntime import KVRuntimeError
from kvruntime.methods.distilled.oracle import ORACLES, STUDENTS

HELD_OUT_EVERY = 4  # prompts 3, 7, 11, ... choose the ridge strength
SHARE_SOURCES = ("repeating", "all")  # the calibration prompts the compiled layer shares are averaged over


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    prompts: int = 32  # calibration prompts (every 4th held out to choose the ridge strength)
    prompt_tokens: int = 2048  # tokens per calibration prompt
    oracle: str = "reconstruction"  # the second pass distilled (ORACLES)
    student: str = "all"  # the features it reads: all, or KVzap's hidden state and bias (STUDENTS)
    seed: int = 0
    # The teacher's allocation on prose starves layers that repeated text needs, and it is less faithful on prose
    # too than the allocation of the prompts whose text repeats (docs/methods/distilled.md); all prompts' when none
    # repeats.
    shares_from: str = "repeating"

    def check(self) -> None:
        if self.oracle not in ORACLES:
            raise KVRuntimeError(f"--oracle {self.oracle!r}: use one of {', '.join(ORACLES)}")
        if self.student not in STUDENTS:
            raise KVRuntimeError(f"--student {self.student!r}: use one of {', '.join(STUDENTS)}")
        if self.shares_from not in SHARE_SOURCES:
            raise KVRuntimeError(f"--shares-from {self.shares_from!r}: use one of {', '.join(SHARE_SOURCES)}")
        if self.prompts < HELD_OUT_EVERY:
            raise KVRuntimeError(f"--prompts must be at least {HELD_OUT_EVERY} (every {HELD_OUT_EVERY}th is held out)")
        if self.prompt_tokens < 64:
            raise KVRuntimeError("--prompt-tokens must be at least 64")
