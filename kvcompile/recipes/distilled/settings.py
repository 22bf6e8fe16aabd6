"""The settings of `distilled`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvcompile.settings import Settings, option, prompt_tokens_option, scaled_count, seed_option
from kvruntime import KVRuntimeError
from kvruntime.methods.distilled.oracle import LOOKAHEAD_ON, MAX_LOOKAHEAD_QUERIES, ORACLES, STUDENTS

if TYPE_CHECKING:
    from kvcompile.calibration.forward_costs import ForwardCosts
    from kvruntime.artifacts.fingerprint import ModelFingerprint

HELD_OUT_EVERY = 4  # prompts 3, 7, 11, ... choose the ridge strength


@dataclasses.dataclass(frozen=True)
class DistillSettings(Settings):
    prompts: int = option(32, "Calibration prompts (every 4th held out to choose the ridge strength).")
    prompt_tokens: int = prompt_tokens_option(2048)
    oracle: str = option(
        "reconstruction",
        "The second pass distilled: reconstruction (the context again), repeat (behind an instruction) or kvzip_plus "
        "(KVzap's output-weighted attention, behind the instruction).",
        choices=ORACLES,
    )
    student: str = option(
        "all",
        "The features the student reads: all (attention input, position, first token, likeness) or hidden (KVzap's: "
        "the attention input and a bias; exportable to kvpress's KVzapModel).",
        choices=STUDENTS,
    )
    seed: int = seed_option()
    # The teacher's allocation on prose starves layers that repeated text needs, and it is less faithful on prose
    # too than the allocation of the prompts whose text repeats (docs/methods/distilled.md); all prompts' when none
    # repeats.
    shares_from: str = option(
        "repeating",
        "The calibration prompts the compiled layer shares are averaged over: repeating (those whose text repeats, a "
        "quarter of their 8-grams seen earlier in them; all when none does) or all.",
        choices=("repeating", "all"),
    )

    # Their attention over the whole context adds what one token's features cannot see (docs/methods/distilled.md).
    lookahead_queries: int = option(
        16,
        "Lookahead queries trained after the fit (0: none). A run split into shares and merged gets none.",
    )
    lookahead_steps: int = option(400, "Training steps of the lookahead queries (one context each).")
    lookahead_prompts: int = option(12, "Calibration contexts the lookahead queries are trained on.")
    lookahead_held_out: int = option(
        4, "Further calibration contexts the trained queries' KL to the oracle is measured on, never trained on."
    )
    lookahead_tokens: int = option(
        1024, "Tokens per context the lookahead queries are trained on (at most --prompt-tokens)."
    )
    # On Gemma 3 the queries cost repeated filler what they gain on every other text (docs/methods/distilled.md).
    lookahead_on: str = option(
        "all",
        "The prompts the runtime feeds the lookahead queries after: all, or non-repeating (a prompt whose text "
        "repeats, a quarter of its 8-grams seen earlier in it, is then scored by the student alone).",
        choices=LOOKAHEAD_ON,
    )

    def scaled(self, scale: float) -> DistillSettings:
        """Fewer and shorter prompts (at least 8 of 1,024 tokens), fewer lookahead contexts (at least 4 and 2 held
        out) and steps (at least 100), by `scale` (`kvcompile compile --minutes`)."""
        return dataclasses.replace(
            self,
            prompts=scaled_count(self.prompts, scale, 2 * HELD_OUT_EVERY, multiple=HELD_OUT_EVERY),
            prompt_tokens=scaled_count(self.prompt_tokens, scale, 1024, multiple=256),
            lookahead_steps=scaled_count(self.lookahead_steps, scale, 100),
            lookahead_prompts=scaled_count(self.lookahead_prompts, scale, 4),
            lookahead_held_out=scaled_count(self.lookahead_held_out, scale, 2),
        )

    def estimated_seconds(self, costs: ForwardCosts, model: ModelFingerprint) -> float:
        """Each prompt a prefill and the teacher's second pass; the lookahead queries' contexts the same, then their
        training steps (`kvcompile compile`'s estimate)."""

        def pass_seconds(tokens: int) -> float:  # a prefill and the teacher's second pass
            return costs.prefill(tokens) + costs.second_pass(tokens)

        seconds = self.prompts * pass_seconds(self.prompt_tokens)
        if self.lookahead_queries:
            contexts = self.lookahead_prompts + self.lookahead_held_out
            tokens = min(self.lookahead_tokens, self.prompt_tokens)
            seconds += contexts * pass_seconds(tokens) + self.lookahead_steps * costs.query_step
        return seconds

    def check_values(self) -> None:
        if self.prompts < HELD_OUT_EVERY:
            raise KVRuntimeError(f"--prompts must be at least {HELD_OUT_EVERY} (every {HELD_OUT_EVERY}th is held out)")
        if self.prompt_tokens < 64:
            raise KVRuntimeError("--prompt-tokens must be at least 64")
        if not 0 <= self.lookahead_queries <= MAX_LOOKAHEAD_QUERIES:
            raise KVRuntimeError(f"--lookahead-queries must be between 0 and {MAX_LOOKAHEAD_QUERIES}")
        if self.lookahead_queries and min(self.lookahead_steps, self.lookahead_prompts) < 1:
            raise KVRuntimeError("--lookahead-steps and --lookahead-prompts must be at least 1")
        if self.lookahead_held_out < 0:
            raise KVRuntimeError("--lookahead-held-out must be at least 0")
        if self.lookahead_queries and self.lookahead_tokens < 64:
            raise KVRuntimeError("--lookahead-tokens must be at least 64")
