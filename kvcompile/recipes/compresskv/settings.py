"""The settings of `compresskv`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses

from kvruntime import KVRuntimeError

MIN_PROBE_TOKENS = 128  # a needle sentence, its question and some haystack around it


@dataclasses.dataclass(frozen=True)
class HeadsSettings:
    """The needle-probe grid: context lengths (tokens) x needle depths (0 = start, 1 = end) x needles."""

    lengths: tuple[int, ...] = (512, 1024, 1536, 2048)
    depths: tuple[float, ...] = (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1)
    seed: int = 0
    chat: bool = True  # probes in the model's chat template (instruct models), else raw text

    def check(self) -> None:
        if not self.lengths or not self.depths or any(not 0 <= d <= 1 for d in self.depths):
            raise KVRuntimeError("--lengths needs at least one length and --depths values in [0, 1]")
        if min(self.lengths) < MIN_PROBE_TOKENS:
            raise KVRuntimeError(
                f"--lengths {min(self.lengths)}: a needle probe needs at least {MIN_PROBE_TOKENS} tokens"
            )


@dataclasses.dataclass(frozen=True)
class BudgetsSettings:
    prompts: int = 24  # calibration prompts
    prompt_tokens: int = 1024  # tokens per calibration prompt
    new_tokens: int = 32  # greedy decoding steps measured per prompt
    seed: int = 0

    def check(self) -> None:
        if min(self.prompts, self.prompt_tokens, self.new_tokens) < 1:
            raise KVRuntimeError("--prompts, --prompt-tokens and --new-tokens must be positive")
