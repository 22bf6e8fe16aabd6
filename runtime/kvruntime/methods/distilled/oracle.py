"""What a distilled scorer was distilled from: the second pass `kvcompile distill` ran (its oracle), shared with the
runtime so that `distilled:scores=oracle` replays it on the prompt (the teacher, two passes) under the student's
selection rule.

Each oracle feeds a task after the context (the context again, after a recorded prefix of token ids) and scores
each context token per (layer, KV head):
- `reconstruction` (KVCompose's task-agnostic pass) and `repeat` (the same behind "repeat the text"): the largest
  attention from the copy, mean over the KV head's query heads plus the mean over the layer's KV heads;
- `kvzip_plus` (KVzap's target, behind "repeat the text"): the largest output-weighted attention (KVzip+, see
  `kvruntime.plumbing.second_pass`), max over the KV head's query heads.
Torch-free at import: `kvcompile distill` checks its --oracle against `ORACLES` before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ORACLES = ("reconstruction", "repeat", "kvzip_plus")
STUDENTS = ("all", "hidden")  # the features a student reads (`features.student_features`)
MAX_LOOKAHEAD_QUERIES = 256  # positions a scorer's lookahead queries append to every prompt (`kvcompile distill`)
# The prompts a scorer's lookahead queries score with its student: every prompt, or those whose text does not repeat
# (`repetition.repeats`; a prompt that repeats is then scored by the student alone). Chosen per model when it is
# compiled (docs/methods/distilled.md).
LOOKAHEAD_ON = ("all", "non-repeating")
PREFIXED = ("repeat", "kvzip_plus")  # the oracles whose copy follows an instruction (the artifact records its ids)


def second_pass_target(oracle: str) -> str:
    """What the oracle's second pass measures (`kvruntime.plumbing.second_pass.TARGETS`)."""
    return "kvzip_plus" if oracle == "kvzip_plus" else "attention"


def oracle_scores(task_max: torch.Tensor, num_kv_heads: int, oracle: str) -> torch.Tensor:
    """One layer's second-pass maxima [B, Hq, N] as the oracle's scores per KV head [B, Hkv, N]."""
    from ...math.composite_tokens import kv_head_scores
    from ...plumbing.second_pass import kv_head_max

    return kv_head_max(task_max, num_kv_heads) if oracle == "kvzip_plus" else kv_head_scores(task_max, num_kv_heads)


def oracle_targets(scores: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """What the student regresses on: the log of the oracle's scores (clamped at `floor`), so that the fit spreads
    over the whole ranking instead of the few largest values."""
    return scores.double().clamp(min=floor).log()
