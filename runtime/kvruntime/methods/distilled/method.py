"""Distilled (kvcompile's own): one prefill, each layer scores its tokens from its own inputs with the weights of a
`distilled_scorer` artifact, a linear student of what a second pass over the context finds (`kvcompile distill`).

Each KV head keeps its own best tokens in its layer's shared slots (composite tokens: every removed byte is freed).
How many each layer keeps (`allocation`): `compiled`, the layer shares the teacher's allocation gave the calibration
prompts, compiled per ratio and known before the prefill, so each layer is cut inside it and a long prompt streams;
`dynamic`, one global pool of the layers' composite tokens ranked by their predicted scores after every layer gets
`floor` times the average count (it holds the whole prompt until the prefill ends); `uniform`, the same count in
every layer; `distilled+error-aware`, CompressKV's error-aware budgets from a `layer_budgets` artifact (`layer_error`).
The last `window` tokens and the first `sinks` always stay: a second pass that weighs what a token adds to the
output scores the attention sink low, and dropping it shifts every layer's attention. `leverage` mixes each key's
leverage among the layer's keys into the student's scores (`leverage.py`). A token's predicted score depends only on
its own inputs, the tokens before it and the prompt's ids (`copy_penalty`: the earlier copies of a repeated text
give way to the last), so with budgets known in advance a prompt streamed in chunks gets the scores it would have had
in one piece (given the same hidden states).

`lookahead="auto"` (the default) with a scorer that holds lookahead queries (`kvcompile distill`): after a prefill
of the whole prompt, the queries are fed after it (n tokens, their entries never kept) and each token's log-score is
the mean of the student's and the log of the queries' mean attention; the layers are then held until the prefill
ends. A prompt streamed in chunks is cut inside the prefill by the student alone, and so is a prompt that repeats
when the scorer's queries are compiled for the others only (its `lookahead_on`).

`scores="oracle"` is the teacher: the scorer's oracle replayed on the prompt (a second pass, `oracle.py`) under the
same selection rule, to measure what the student could reach. What each choice costs and gains:
docs/methods/distilled.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...errors import KVRuntimeError
from ...math.allocation import apportion, error_aware_budgets, refloored_shares, shares_at_ratio
from ...math.composite_tokens import prompt_allocation
from ...math.repetition import repeats
from ...math.selection import protect_sinks, protect_window
from ...registry import ERROR_AWARE, option_fields
from ...requests.request import KeepPlan
from ..base import LayerInputs, Method, PrefillResult, Selection
from .features import feature_count, predicted_token_scores, running_state_sum
from .leverage import with_leverage
from .oracle import PREFIXED, oracle_scores, oracle_targets, second_pass_target
from .scorer import DistilledScorer
from .spec import SPEC

# The lookahead queries' weight in the scores they give with the student (`with_lookahead_scores`): an even mean,
# measured in issue #74 (the queries alone and trained as the student's residual both held less).
LOOKAHEAD_SHARE = 0.5


@dataclasses.dataclass
class Distilled(option_fields(SPEC), Method):  # its options (allocation, floor, sinks, ...): the registration's
    scorer: DistilledScorer | None = None
    # [L] from a layer_budgets artifact: error-aware layer budgets instead of `allocation` (`distilled+error-aware`, which
    # takes no options: the registry refuses them)
    layer_error: torch.Tensor | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return SPEC.name if self.layer_error is None else f"{SPEC.name}+{ERROR_AWARE}"

    def __post_init__(self) -> None:
        if self.scorer is None:
            raise KVRuntimeError("distilled needs a distilled_scorer artifact (compile it with `kvcompile distill`)")
        if self.scores == "oracle" and self.scorer.oracle in PREFIXED and not self.scorer.task_prefix:
            raise KVRuntimeError(
                f"this distilled_scorer does not record its {self.scorer.oracle} oracle's instruction: "
                "recompile it with `kvcompile distill` to replay its oracle"
            )

    @property
    def budgets_known_in_advance(self) -> bool:
        # `distilled+error-aware`: the layer_budgets artifact gives the budgets before the prefill (as `method_facts`)
        return self.layer_error is not None or super().budgets_known_in_advance

    def layer_budgets(self, num_layers: int, plan: KeepPlan) -> list[int]:
        if self.layer_error is not None:
            return error_aware_budgets(self.layer_error.tolist(), plan.keep, length=plan.length)
        if self.allocation == "uniform":
            return [plan.keep] * num_layers
        if self.allocation == "compiled":
            shares = self._compiled_shares(plan)[0]
            return apportion(shares, plan.keep * num_layers, low=plan.window, high=plan.length).tolist()
        return super().layer_budgets(num_layers, plan)

    def budgets_note(self, plan: KeepPlan) -> str:
        return f"{self._fixed_budgets(plan)} over {self._student_source(plan)}"

    def _student_source(self, plan: KeepPlan) -> str:
        """Where the scores of a prompt cut without the lookahead queries came from, for the report."""
        alone = " (the student alone: the prompt repeats)" if self._repeats_without_queries(plan) else ""
        return f"scores distilled from {self.scorer.oracle}{alone}"

    def _fixed_budgets(self, plan: KeepPlan) -> str:
        if self.layer_error is not None:
            return "error-aware budgets (layer_budgets)"
        if self.allocation == "compiled":
            return f"compiled allocation ({self._compiled_shares(plan)[1]})"
        return "uniform allocation"

    def _compiled_shares(self, plan: KeepPlan) -> tuple[torch.Tensor, str]:
        """The scorer's compiled layer shares at this plan's ratio [L], and how they were had (asked for before the
        prefill: a scorer compiled before issue #33 holds none)."""
        if self.scorer.layer_shares is None:
            raise KVRuntimeError(
                "this distilled_scorer holds no compiled layer shares (allocation=compiled, the default): recompile "
                "it with `kvcompile distill`, or use allocation=dynamic"
            )
        shares, how = shares_at_ratio(self.scorer.share_ratios, self.scorer.layer_shares, plan.ratio)
        floor, why = self.floor, ""
        if plan.repeated is not None and repeats(plan.repeated):
            floor, why = self.repeating_floor, f" (the prompt repeats: {plan.repeated:.2f} of its 8-grams)"
        if floor == self.scorer.share_floor:
            return shares, how + why
        return refloored_shares(shares, self.scorer.share_floor, floor), f"{how}, floor {floor:g}{why}"

    def rescores_whole_prompt(self, plan: KeepPlan) -> bool:
        return self.appended_queries is not None and not self._repeats_without_queries(plan)

    @property
    def appended_queries(self) -> torch.Tensor | None:
        if self.scores == "predicted" and self.lookahead == "auto":
            return self.scorer.lookahead_queries
        return None

    def _repeats_without_queries(self, plan: KeepPlan) -> bool:
        """A prompt that repeats, for a scorer whose queries score the others only: the student scores it alone."""
        return (
            self.appended_queries is not None
            and self.scorer.lookahead_on == "non-repeating"
            and plan.repeated is not None
            and repeats(plan.repeated)
        )

    def reads_token_ids(self) -> str | None:
        reading = [f"copy_penalty={self.copy_penalty:g}"] if self.copy_penalty else []
        if self.allocation == "compiled" and self.layer_error is None and self.repeating_floor != self.floor:
            reading.append(f"repeating_floor={self.repeating_floor:g}")
        if self.appended_queries is not None and self.scorer.lookahead_on == "non-repeating":
            reading.append("the lookahead queries (its scorer's are for prompts that do not repeat)")
        return " and ".join(reading) or None

    def with_layer_budgets(self, layer_error: torch.Tensor) -> Distilled:
        return dataclasses.replace(self, layer_error=layer_error)

    def layer_statistics(self, layer: LayerInputs) -> torch.Tensor | None:
        # The teacher scores in its second pass (`select`).
        return None if self.scores == "oracle" else self.stream_scores(layer, None, None)[0]

    def stream_scores(
        self, layer: LayerInputs, held: torch.Tensor | None, carry: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact in chunks: a token's score depends on its own inputs, through `carry` (the running sum of the
        earlier states, `running_state_sum`) on the tokens before it, and through `copy_penalty` on the prompt's ids
        (known before the prefill); the held entries keep their scores. With `leverage`, the chunk's keys' leverage
        among the keys held (`with_leverage`)."""
        scores = self.token_scores(layer.index, layer.hidden_states, layer.start, carry)
        fresh = scores.shape[-1]
        if self.copy_penalty and layer.plan is not None and layer.plan.later_occurrences is not None:
            scores = with_copy_penalty(scores, layer.plan.later_occurrences, layer.start, self.copy_penalty)
        if held is not None:
            scores = torch.cat([held, scores], dim=-1)
        if layer.final:
            scores = protect_window(scores, min(self.window, scores.shape[-1]))
        scores = with_leverage(scores, layer.keys, self.leverage, fresh)
        return scores, running_state_sum(layer.hidden_states, layer.start, carry)

    def token_scores(
        self, layer: int, hidden_states: torch.Tensor, start: int = 0, carry: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The student's scores [B, Hkv, n] of a layer's tokens from its attention input [B, n, hidden] (a chunk
        starting at position `start`, `carry` as in `stream_scores`), the first `sinks` tokens protected; the
        window is not (the caller knows where the prompt ends)."""
        weights = self.scorer.weights[layer].to(hidden_states.device)
        if weights.shape[0] != feature_count(hidden_states.shape[-1]):
            raise KVRuntimeError(
                f"the distilled_scorer reads {weights.shape[0]} features per token, this runtime makes "
                f"{feature_count(hidden_states.shape[-1])}: recompile it with `kvcompile distill`"
            )
        scores = predicted_token_scores(hidden_states, weights, start, carry)
        return protect_sinks(scores, self.sinks) if start == 0 else scores

    def select(self, statistics: list[torch.Tensor | None], plan: KeepPlan, prefill: PrefillResult) -> Selection:
        looks_ahead = self.rescores_whole_prompt(plan)
        if self.scores == "oracle":
            statistics = self._oracle_scores(plan, prefill)
        elif looks_ahead:
            statistics = self._with_lookahead(statistics, plan, prefill)
        num_layers, (batch, num_kv_heads, length) = len(statistics), statistics[0].shape
        if batch != 1:
            raise KVRuntimeError(f"distilled selects for batch size 1 only (got {batch})")
        keep = plan.keep
        if self.allocation == "dynamic" and self.layer_error is None:
            counts = dynamic_layer_counts(torch.stack([s[0] for s in statistics]), keep, self.floor)
            how = f"dynamic allocation (floor {self.floor:g})"
        else:  # the teacher under budgets the student would have cut inside the prefill
            counts = torch.tensor(self.layer_budgets(num_layers, plan))
            how = self._fixed_budgets(plan)
        if self.scores == "oracle":
            source = f"the {self.scorer.oracle} oracle (two passes)"
        elif looks_ahead:
            queries = self.scorer.lookahead_queries.shape[0]
            source = f"scores distilled from {self.scorer.oracle} with {queries} lookahead queries"
        else:
            source = self._student_source(plan)
        note = (
            f"{self.name:<19} {how} over {source}; tokens kept per layer {int(counts.min())}-{int(counts.max())} "
            f"of {length}"
        )
        return Selection(statistics, counts[:, None].expand(num_layers, num_kv_heads).clone(), [note])

    def _with_lookahead(
        self, statistics: list[torch.Tensor], plan: KeepPlan, prefill: PrefillResult
    ) -> list[torch.Tensor]:
        """The student's log-scores averaged with the lookahead queries' (the log of their mean attention per KV
        head); the copy penalty stays whole, the window and sinks protected."""
        means = prefill.lookahead_attention(self.scorer.lookahead_queries)
        combined = []
        for student, mean in zip(statistics, means):
            scores = with_lookahead_scores(student, lookahead_log_scores(mean, prefill.num_kv_heads).to(student.device))
            if self.copy_penalty and plan.later_occurrences is not None:  # scaled with the student's: give it back
                scores = with_copy_penalty(scores, plan.later_occurrences, 0, LOOKAHEAD_SHARE * self.copy_penalty)
            combined.append(scores)
        return combined

    def _oracle_scores(self, plan: KeepPlan, prefill: PrefillResult) -> list[torch.Tensor]:
        """The teacher's log-scores per layer [B, Hkv, N], the window and the sinks protected as the student's are."""
        oracle = self.scorer.oracle
        maxima = prefill.second_pass_attention(prefix=self.scorer.task_prefix, target=second_pass_target(oracle))
        return [
            protect_sinks(
                protect_window(oracle_targets(oracle_scores(m, prefill.num_kv_heads, oracle)).float(), plan.window),
                self.sinks,
            )
            for m in maxima
        ]


def with_lookahead_scores(student: torch.Tensor, lookahead: torch.Tensor) -> torch.Tensor:
    """The student's log-scores and the lookahead queries' (`lookahead_log_scores`), of any matching shape, as one
    score: their mean (`LOOKAHEAD_SHARE`)."""
    return (1 - LOOKAHEAD_SHARE) * student + LOOKAHEAD_SHARE * lookahead


def lookahead_log_scores(mean_attention: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The lookahead queries' mean attention [B, Hq, N] as log-scores per KV head [B, Hkv, N]: the mean over the KV
    head's query heads (what `kvcompile distill` trains), its log clamped at 1e-12."""
    batch, num_query_heads, length = mean_attention.shape
    grouped = mean_attention.view(batch, num_kv_heads, num_query_heads // num_kv_heads, length).mean(dim=2)
    return grouped.clamp(min=1e-12).log()


def with_copy_penalty(scores: torch.Tensor, later: torch.Tensor, start: int, penalty: float) -> torch.Tensor:
    """The log-scores [B, Hkv, n] of a chunk starting at `start`, each lowered by `penalty` per doubling of the
    times its 8-gram occurs again later in the prompt (`later` [N], `repetition.later_occurrences`)."""
    again = later[start : start + scores.shape[-1]].to(device=scores.device, dtype=scores.dtype)
    return scores - penalty * torch.log2(1.0 + again)


def dynamic_layer_counts(log_scores: torch.Tensor, keep: int, floor: float) -> torch.Tensor:
    """The dynamic allocation: tokens kept per layer [L] from one prompt's log-scores [L, Hkv, N] (the window
    protected), `keep` per layer on average, each layer at least `floor` times that. The scores are log-scores: the
    global pool compares the scores themselves, as KVCompose does."""
    return prompt_allocation(log_scores.exp(), keep, per_head=False, floor=int(floor * keep))


def build(compiled: Any, options: dict[str, object]) -> Distilled:
    return Distilled(scorer=compiled, **options)
