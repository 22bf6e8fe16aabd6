"""The settings of `compresskv`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvcompile.settings import Settings, option, prompt_tokens_option, scaled_count, seed_option
from kvruntime import KVRuntimeError

if TYPE_CHECKING:
    from kvcompile.calibration.forward_costs import ForwardCosts
    from kvruntime.artifacts.fingerprint import ModelFingerprint

MIN_PROBE_TOKENS = 128  # a needle sentence, its question and some haystack around it
ANSWER_STEPS = 30  # tokens a probe's answer decodes: its needle sentence and 8 more, at most


@dataclasses.dataclass(frozen=True)
class HeadsSettings(Settings):
    """The needle-probe grid: context lengths (tokens) x needle depths (0 = start, 1 = end) x needles."""

    lengths: tuple[int, ...] = option((512, 1024, 1536, 2048), "Probe context lengths in tokens.")
    depths: tuple[float, ...] = option(
        (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1), "Needle depths (0 = start, 1 = end)."
    )
    chat: bool = option(  # probes in the model's chat template (instruct models), else raw text
        True,
        "chat (the model's chat template) or raw (base models).",
        choices={"chat": True, "raw": False},
        flag="--prompt-format",
    )
    seed: int = seed_option()

    def scaled(self, scale: float) -> HeadsSettings:
        """Fewer depths (evenly spread, both ends kept, at least 3) and the shorter lengths (at least 2), by `scale`
        (0-1: `kvcompile compile --minutes`)."""
        depths = scaled_count(len(self.depths), scale, 3)
        return dataclasses.replace(
            self,
            lengths=tuple(sorted(self.lengths)[: scaled_count(len(self.lengths), scale, 2)]),
            depths=tuple(round(i / (depths - 1), 2) for i in range(depths)),
        )

    def estimated_seconds(self, costs: ForwardCosts, model: ModelFingerprint) -> float:
        """Each probe (lengths x depths x needles) a prefill, then the needle sentence decoded (`kvcompile compile`'s
        estimate)."""
        from kvcompile.tasks.needles import CALIBRATION_NEEDLES

        probes = len(self.depths) * len(CALIBRATION_NEEDLES)
        return probes * sum(costs.prefill(length) + ANSWER_STEPS * costs.decode for length in self.lengths)

    def check_values(self) -> None:
        if not self.lengths or not self.depths or any(not 0 <= d <= 1 for d in self.depths):
            raise KVRuntimeError("--lengths needs at least one length and --depths values in [0, 1]")
        if min(self.lengths) < MIN_PROBE_TOKENS:
            raise KVRuntimeError(
                f"--lengths {min(self.lengths)}: a needle probe needs at least {MIN_PROBE_TOKENS} tokens"
            )


@dataclasses.dataclass(frozen=True)
class LayerErrorsSettings(Settings):
    prompts: int = option(24, "Calibration prompts.")
    prompt_tokens: int = prompt_tokens_option(1024)
    new_tokens: int = option(32, "Greedy decoding steps measured per prompt.")
    seed: int = seed_option()

    def scaled(self, scale: float) -> LayerErrorsSettings:
        """Fewer prompts (at least 6) and decoding steps (at least 8), by `scale` (`kvcompile compile --minutes`)."""
        return dataclasses.replace(
            self, prompts=scaled_count(self.prompts, scale, 6), new_tokens=scaled_count(self.new_tokens, scale, 8)
        )

    def estimated_seconds(self, costs: ForwardCosts, model: ModelFingerprint) -> float:
        """Each prompt a prefill, then `new_tokens` decoded (`kvcompile compile`'s estimate)."""
        return self.prompts * (costs.prefill(self.prompt_tokens) + self.new_tokens * costs.decode)

    def check_values(self) -> None:
        if min(self.prompts, self.prompt_tokens, self.new_tokens) < 1:
            raise KVRuntimeError("--prompts, --prompt-tokens and --new-tokens must be positive")
