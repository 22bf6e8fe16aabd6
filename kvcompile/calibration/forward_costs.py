"""What a model's forwards cost on this machine (`forward_probe.measure_forward_costs` times them before `kvcompile
compile` starts): the compile commands' time estimates (`estimated_seconds` of each settings dataclass) are sums of
these. Torch-free, as the settings that read it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    """Seconds of a model's forwards: a prompt's prefill and its second pass as a + b x tokens per token (fitted
    through two lengths), and per unit of the rest."""

    prefill_per_token: tuple[float, float]  # (a, b): a prefill (the last position's logits only)
    second_pass_per_token: tuple[float, float]  # (a, b): the copy's attention maxima after a prefill (`stats`)
    decode: float  # per greedy step over a prompt's cache
    scored: float  # per token of a batch of continuations with every position's logits (a rollout)
    query_step: float  # per training step of lookahead queries: their forward over a cache, and back to them

    def prefill(self, tokens: int) -> float:
        a, b = self.prefill_per_token
        return tokens * (a + b * tokens)

    def second_pass(self, tokens: int) -> float:
        a, b = self.second_pass_per_token
        return tokens * (a + b * tokens)
