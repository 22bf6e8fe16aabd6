"""The settings of `compilerkv`'s compile command and what they are checked against, torch-free: `recipe.py`
checks them before the work is imported, and the work modules read them from here (not from `recipe.py`, which
imports the work)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from kvcompile.settings import Settings, option, scaled_count, seed_option
from kvruntime import KVRuntimeError
from kvruntime.methods.compilerkv.operating_points import UTILITIES
from kvruntime.registry import METHODS

if TYPE_CHECKING:
    from kvcompile.calibration.forward_costs import ForwardCosts
    from kvruntime.artifacts.fingerprint import ModelFingerprint

WINDOW = METHODS["compilerkv"].window  # the runtime method's observation window: the rollouts see what it sees
LOSSES = ("nll", "kl")  # the rollouts' loss: the continuation's NLL (the paper's) or its KL from the full cache
CONTINUATIONS = ("corpus", "greedy")  # whose continuation is scored: the corpus's or the full-cache model's own


@dataclasses.dataclass(frozen=True)
class ExperienceDesign:
    """How much is probed per (prompt, budget): (layer, KV group) pairs x weights for the head table (every query
    head of a probed group gets the same weights), layers x thresholds for the gate. None: every pair or layer on
    every unit; given `head_weights` / `gate_thresholds`, exactly those actions instead of a sample of the grid."""

    head_groups: int | None = 2  # (layer, KV group) pairs probed for the head table
    head_actions: int = 8  # weight settings tried on each
    gate_layers: int | None = 4  # layers probed for the gate table
    gate_actions: int = 7  # thresholds tried on each
    action_stride: int = 1  # actions are drawn from every `action_stride`-th grid point (more records per action)
    head_weights: tuple[float, ...] = ()
    gate_thresholds: tuple[float, ...] = ()

    def rollouts(self, model: ModelFingerprint, reference: bool) -> int:
        """About how many continuations a unit rolls out: the base (and the full cache's, for the KL), then each
        probe; every-state's probes at a neutral weight repeat the base (about half of its head probes)."""
        layers, heads, groups = model.num_layers, model.num_query_heads, model.num_kv_heads
        if self.head_weights:
            head_probes = layers * heads * len(self.head_weights) // 2
        else:
            pairs = layers * groups if self.head_groups is None else min(self.head_groups, layers * groups)
            head_probes = pairs * (heads // groups) * self.head_actions
        gate_layers = layers if self.gate_layers is None else min(self.gate_layers, layers)
        gate_probes = gate_layers * (len(self.gate_thresholds) or self.gate_actions)
        return 1 + int(reference) + head_probes + gate_probes


# Named designs (`kvcompile tables --design`). "sampled": a few states and many actions per unit, the tables'
# current actions as the base (the paper's shape). "every-state": every state on every prompt with few actions from
# neutral tables, so each state's records number the prompts (benchmarks/compilerkv/compilerkv_oracle_tables.md).
DESIGNS = {
    "sampled": ExperienceDesign(),
    "every-state": ExperienceDesign(
        head_groups=None, gate_layers=None, head_weights=(1.0, 1.5), gate_thresholds=(0.8, 0.9, 1.0)
    ),
}


@dataclasses.dataclass(frozen=True)
class CQLSettings:
    """Defaults from the authors' code (alpha, AdamW, weight decay); steps and batch sized for our data."""

    alpha: float = 0.75  # weight of the conservative penalty on unseen actions
    learning_rate: float = 3e-4  # AdamW
    weight_decay: float = 0.01  # AdamW
    batch_size: int = 256  # records per gradient step
    steps: int = 2000  # gradient steps per fit
    epochs: int = 10  # learning-curve points per fit (steps are split evenly)
    seed: int = 0


CQL_FIT_SECONDS = 15.0  # one d3rlpy DiscreteCQL fit of the tables on the CPU, about (10-20 s measured)


# The defaults are the shipped tables' (every state on every prompt, the KL on the model's own continuations, one
# threshold per layer: the sampled design's tables agreed by chance, docs/methods/compilerkv.md). The paper's shape:
# --design sampled --loss nll --continuation-from corpus --budgets 256,512 --prompts 32 --rounds 2
# --entropy-bins 20 --perplexity-bins 4.
@dataclasses.dataclass(frozen=True)
class TablesSettings(Settings):
    budgets: tuple[int, ...] = option((256,), "Budgets (tokens per layer, window included) to compile tables for.")
    prompts: int = option(16, "Calibration prompts (context + continuation).")
    candidates: int = option(
        64, "Candidate prompts whose risk is measured; --prompts of them are chosen across the risk cells."
    )
    strata: tuple[int, int] = (4, 2)  # entropy x perplexity cells the chosen prompts are spread over
    context_tokens: int = option(2048, "Tokens of context per calibration prompt.", old_flags=("--context",))
    continuation: int = option(128, "Tokens of continuation whose NLL is the reward.")
    rounds: int = option(1, "At most this many rounds of head then gate learning.")
    tolerance: float = 0.02  # stop once fewer than this share of both tables' entries change in a round
    entropy_bins: int = option(
        1, "Entropy bins of the risk gate (1 with --perplexity-bins 1: one threshold per layer)."
    )
    perplexity_bins: int = option(1, "Window-perplexity bins of the risk gate.")
    penalty: float = 1.0  # the over-budget penalty's weight (elastic rule only)
    elastic: bool = option(
        False,
        "Learn for the paper's elastic gate (a layer keeps only tokens above its threshold) instead of the "
        "ratio-honest runtime default (the layers share the budget).",
    )
    utility: str = option(
        "head",
        "The stabilized utility the weights act on: global (the spec's: one attention mass for every head) or head "
        "(each query head's own window attention averaged with it, so every head's weight matters; the default: "
        "more signal per probe and a lower loss, benchmarks/compilerkv/compilerkv_reward_noise.md).",
        choices=UTILITIES,
    )
    loss: str = option(
        "kl",
        "The rollouts' loss: nll (the continuation's NLL, the paper's reward) or kl (its KL divergence from the full "
        "cache's next-token distributions: the same expectation, about half the noise).",
        choices=LOSSES,
    )
    continuation_from: str = option(
        "greedy",
        "Whose continuation is scored: corpus (the text's own) or greedy (the full-cache model's).",
        choices=CONTINUATIONS,
    )
    design: ExperienceDesign = option(
        DESIGNS["every-state"],
        "The experience design: sampled (a few states per prompt, many actions: the paper's shape) or every-state "
        "(every head and layer probed on every prompt with weights 1.0/1.5 and thresholds 0.8/0.9/1.0 from neutral "
        "tables: as many records per state as prompts).",
        choices=DESIGNS,
    )
    cql: CQLSettings = CQLSettings()
    seed: int = seed_option()
    batch_size: int = 8  # variants decoded together

    def scaled(self, scale: float) -> TablesSettings:
        """Fewer prompts (at least 8, one per risk cell), candidates (at least twice the prompts) and shorter
        continuations (at least 32 tokens), by `scale` (`kvcompile compile --minutes`)."""
        prompts = scaled_count(self.prompts, scale, self.strata[0] * self.strata[1])
        return dataclasses.replace(
            self,
            prompts=prompts,
            candidates=max(scaled_count(self.candidates, scale, 16), 2 * prompts),
            continuation=scaled_count(self.continuation, scale, 32),
        )

    def estimated_seconds(self, costs: ForwardCosts, model: ModelFingerprint) -> float:
        """The candidates' prefills; each chosen prompt's prefill and scored continuation (and its greedy one);
        then per round, prompt and budget a rollout of the continuation per probe, and the CQL fits (`kvcompile
        compile`'s estimate)."""
        context, continuation = self.context_tokens, self.continuation
        chosen = costs.prefill(context) + continuation * costs.scored
        if self.continuation_from == "greedy":
            chosen += costs.prefill(context) + continuation * costs.decode
        rollouts = self.rounds * self.prompts * len(self.budgets) * self.design.rollouts(model, self.loss == "kl")
        return (
            self.candidates * costs.prefill(context)
            + self.prompts * chosen
            + rollouts * (continuation - 1) * costs.scored
            + 2 * self.rounds * CQL_FIT_SECONDS
        )

    def check_values(self) -> None:
        if not self.budgets or list(self.budgets) != sorted(set(self.budgets)):
            raise KVRuntimeError(f"--budgets {list(self.budgets)}: give distinct budgets in increasing order")
        if self.budgets[0] <= WINDOW or self.budgets[-1] >= self.context_tokens:
            raise KVRuntimeError(
                f"--budgets must lie between the {WINDOW}-token window and the {self.context_tokens}-token context "
                f"(exclusive), got {list(self.budgets)}: below the window nothing is chosen, above the context "
                "nothing is compressed"
            )
        if self.candidates < self.prompts:
            raise KVRuntimeError(
                f"--candidates {self.candidates}: give at least as many candidate prompts as --prompts {self.prompts}"
            )
        if self.prompts < 2 or self.rounds < 1 or self.continuation < 2 or self.context_tokens <= WINDOW:
            raise KVRuntimeError(
                "--prompts must be at least 2, --rounds at least 1, --continuation at least 2 and --context-tokens "
                f"more than the {WINDOW}-token window"
            )
        if self.entropy_bins < 1 or self.perplexity_bins < 1:
            raise KVRuntimeError("--entropy-bins and --perplexity-bins must be positive")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_experience_format(path: object, kind: str | None, params: dict) -> None:
    """Refuse experience of another kind, or collected before the keep rule was recorded: its rewards were measured
    under the elastic gate with absolute head weights, which the tables learned now would not be run under. Called
    before the tensors' schema check, so an old artifact gets this line rather than a missing tensor's name."""
    if kind != "compilerkv_experience":
        raise KVRuntimeError(f"{path}: a {kind} artifact, not compilerkv_experience")
    if "elastic" not in params:
        raise KVRuntimeError(
            f"{path}: experience from an older kvcompile (collected under the elastic gate with absolute "
            "head weights, before the keep rule was recorded): collect it again with `kvcompile tables`"
        )


def experience_path(tables: Path) -> Path:
    """Where the experience behind the tables at `tables` is written: `<stem>.experience.safetensors` beside them
    (its own name for every --out, so runs into one folder never share it)."""
    return tables.with_name(f"{tables.stem}.experience.safetensors")
