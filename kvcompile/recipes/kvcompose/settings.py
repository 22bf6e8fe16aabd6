"""The settings of `kvcompose`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from kvcompile.settings import Settings, option, prompt_tokens_option, scaled_count, seed_option
from kvruntime import KVRuntimeError
from kvruntime.registry import METHODS

if TYPE_CHECKING:
    from kvcompile.calibration.forward_costs import ForwardCosts
    from kvruntime.artifacts.fingerprint import ModelFingerprint

WINDOW = METHODS["kvcompose"].window  # the runtime's protected window: the least a layer keeps


@dataclasses.dataclass(frozen=True)
class TaskSet:
    """Downstream prompts for the task-aware mode, one per line of a UTF-8 text file."""

    name: str
    prompts: tuple[str, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256("\n".join(self.prompts).encode()).hexdigest()


def load_task_set(path: Path) -> TaskSet:
    if not path.is_file():
        raise KVRuntimeError(f"task set {path} does not exist (a text file with one task prompt per line)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise KVRuntimeError(f"task set {path} is not UTF-8 text") from None
    prompts = tuple(line.strip() for line in lines if line.strip())
    if not prompts:
        raise KVRuntimeError(f"task set {path} holds no prompts (one task prompt per line)")
    return TaskSet(name=str(path), prompts=prompts)


@dataclasses.dataclass(frozen=True)
class StatsSettings(Settings):
    ratios: tuple[float, ...] = option(
        (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95),
        "Target compression ratios to compile the allocation for (others in between are interpolated).",
    )
    prompts: int = option(24, "Calibration prompts.")
    prompt_tokens: int = prompt_tokens_option(2048)
    seed: int = seed_option()

    def scaled(self, scale: float) -> StatsSettings:
        """Fewer prompts (at least 6) and shorter ones (at least 512 tokens), by `scale` (`kvcompile compile
        --minutes`)."""
        return dataclasses.replace(
            self,
            prompts=scaled_count(self.prompts, scale, 6),
            prompt_tokens=scaled_count(self.prompt_tokens, scale, 512, multiple=256),
        )

    def estimated_seconds(self, costs: ForwardCosts, model: ModelFingerprint) -> float:
        """Each prompt a prefill and a second pass over it (`kvcompile compile`'s estimate)."""
        return self.prompts * (costs.prefill(self.prompt_tokens) + costs.second_pass(self.prompt_tokens))

    def check_values(self) -> None:
        if not self.ratios or any(not 0 < r < 1 for r in self.ratios):
            raise KVRuntimeError(f"--ratios {list(self.ratios)}: give ratios strictly between 0 and 1")
        if any(b <= a for a, b in zip(self.ratios, self.ratios[1:])):
            raise KVRuntimeError(f"--ratios {list(self.ratios)}: give them in increasing order, each once")
        if self.prompts < 1:
            raise KVRuntimeError("--prompts must be at least 1")
        if self.prompt_tokens < 2 * WINDOW:
            raise KVRuntimeError(f"--prompt-tokens must be at least {2 * WINDOW} (twice the protected window)")
