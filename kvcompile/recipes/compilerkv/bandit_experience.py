"""CompilerKV's offline bandit experience: the action grids, the rewards, and the experience records as a table of
columns that is stored as a safetensors artifact (so tables can be relearned without running the model).

Head experience: state (budget, layer, query head), action = a weight from HEAD_ACTIONS given to that one head
while every other head keeps its current table value. Gate experience: state (budget, layer, entropy bin,
perplexity bin), action = a threshold from GATE_ACTIONS for that layer.

Rewards are paired. A record's reward is the continuation NLL of the same prompt at the same budget under the
current tables (the unit's base rollout) minus its NLL with the action:
    r(p, s, a) = NLL_base(p, b) - NLL_a(p, b)        (elastic rule only: minus penalty * max(0, candidates - B) / n)
Its mean over prompts estimates Q(s, a) - Q(s, current tables): the same ranking of actions as the spec's
-(NLL_a - NLL_full), since NLL_base is fixed within a unit, but prompt difficulty cancels: its variance is
Var_p(NLL_a - NLL_base) / prompts instead of Var_p(NLL_a - NLL_full) / prompts. On the default model one record's
standard deviation is about 0.0013 nats paired (benchmarks/compilerkv/compilerkv_reward_noise.md) against 0.027
unpaired.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvcompile.recipes.compilerkv.settings import check_experience_format
from kvruntime import Artifact, KVRuntimeError

HEAD_ACTIONS = torch.linspace(0.8, 1.5, 29)
GATE_ACTIONS = torch.linspace(0.8, 1.0, 21)
HEAD_FALLBACK = 1.0  # W_head of a state without experience: neutral


def gate_fallback(elastic: bool) -> float:
    """T_gate of a layer without experience: under the elastic rule the most conservative threshold (it keeps the
    most); under the ratio-honest rule, where thresholds only share the budget out, the middle of the grid."""
    return float(GATE_ACTIONS[0]) if elastic else float(GATE_ACTIONS[len(GATE_ACTIONS) // 2])


HEAD_COLUMNS = ("prompt", "budget", "layer", "head", "action", "nll", "base_nll", "round")
GATE_COLUMNS = (
    "prompt",
    "budget",
    "layer",
    "entropy_bin",
    "perplexity_bin",
    "action",
    "nll",
    "base_nll",
    "candidates",
    "round",
)
_FLOAT_COLUMNS = {"nll", "base_nll"}


def paired_reward(nll: torch.Tensor, base_nll: torch.Tensor) -> torch.Tensor:
    """How much the action lowers the continuation's mean NLL below the same prompt's under the current tables."""
    return base_nll - nll


def over_budget_penalty(candidates: torch.Tensor, budget: torch.Tensor, length: int, weight: float) -> torch.Tensor:
    """weight * max(0, candidates - budget) / length: the gate admitted more than the budget holds."""
    return weight * (candidates - budget).clamp_min(0).double() / length


class Records:
    """Experience rows kept as named columns (lists while collecting, tensors when stored)."""

    def __init__(self, columns: tuple[str, ...], data: dict[str, torch.Tensor] | None = None) -> None:
        self.columns = columns
        self.data: dict[str, list] = {c: [] if data is None else data[c].tolist() for c in columns}

    def __len__(self) -> int:
        return len(self.data[self.columns[0]])

    def append(self, **row: float) -> None:
        if set(row) != set(self.columns):
            raise ValueError(f"row has {sorted(row)}, expected {sorted(self.columns)}")
        for name, value in row.items():
            self.data[name].append(value)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}_{name}": self.column(name) for name in self.columns}

    def column(self, name: str) -> torch.Tensor:
        return torch.tensor(self.data[name], dtype=torch.float64 if name in _FLOAT_COLUMNS else torch.long)

    @classmethod
    def from_tensors(cls, columns: tuple[str, ...], tensors: dict[str, torch.Tensor], prefix: str) -> Records:
        missing = [f"{prefix}_{c}" for c in columns if f"{prefix}_{c}" not in tensors]
        if missing:
            raise KVRuntimeError(f"experience lacks the columns {', '.join(missing)}")
        return cls(columns, {c: tensors[f"{prefix}_{c}"] for c in columns})


@dataclasses.dataclass
class Experience:
    """Everything `kvcompile tables` measured: per-prompt signals and the head and gate records."""

    head: Records
    gate: Records
    full_nll: torch.Tensor  # [prompts] continuation NLL over the full cache
    entropy: torch.Tensor  # [prompts] structural risk
    perplexity: torch.Tensor  # [prompts] semantic risk
    candidate_risks: torch.Tensor  # [candidates, 2] entropy and perplexity of every candidate prompt (bin edges)
    chosen: torch.Tensor  # [prompts] the candidate each prompt is
    budgets: tuple[int, ...]
    context_tokens: int
    penalty: float
    elastic: bool  # collected under the elastic rule (the over-budget penalty applies), else ratio-honest

    def head_rewards(self) -> torch.Tensor:
        return paired_reward(self.head.column("nll"), self.head.column("base_nll"))

    def gate_rewards(self) -> torch.Tensor:
        rewards = paired_reward(self.gate.column("nll"), self.gate.column("base_nll"))
        if not self.elastic:  # the layers share the budget: admitting more than it is no violation
            return rewards
        budgets = torch.tensor(self.budgets)[self.gate.column("budget")]
        return rewards - over_budget_penalty(self.gate.column("candidates"), budgets, self.context_tokens, self.penalty)

    def prompt_halves(self, seed: int = 0) -> tuple[Experience, Experience]:
        """The records of two random halves of the prompts (seeded; not by parity: the stratified choice alternates
        risk cells, so even and odd prompts differ in risk), to learn on one and judge on the other."""
        order = torch.randperm(len(self.full_nll), generator=torch.Generator().manual_seed(seed))
        first = order[: len(order) // 2]

        def keep(records: Records, inside: bool) -> Records:
            rows = torch.isin(records.column("prompt"), first) == inside
            return Records(records.columns, {c: records.column(c)[rows] for c in records.columns})

        return tuple(
            dataclasses.replace(self, head=keep(self.head, inside), gate=keep(self.gate, inside))
            for inside in (True, False)
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            **self.head.tensors("head"),
            **self.gate.tensors("gate"),
            "prompt_full_nll": self.full_nll,
            "prompt_entropy": self.entropy,
            "prompt_perplexity": self.perplexity,
            "candidate_risks": self.candidate_risks,
            "prompt_candidate": self.chosen,
            "budgets": torch.tensor(self.budgets),
        }

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> Experience:
        check_experience_format(artifact.path, artifact.kind, artifact.params)
        t = artifact.tensors
        experience = cls(
            head=Records.from_tensors(HEAD_COLUMNS, t, "head"),
            gate=Records.from_tensors(GATE_COLUMNS, t, "gate"),
            full_nll=t["prompt_full_nll"].double(),
            entropy=t["prompt_entropy"].double(),
            perplexity=t["prompt_perplexity"].double(),
            candidate_risks=t["candidate_risks"].double(),
            chosen=t["prompt_candidate"],
            budgets=tuple(int(b) for b in t["budgets"]),
            context_tokens=int(artifact.params["context_tokens"]),
            penalty=float(artifact.params["penalty"]),
            elastic=bool(artifact.params["elastic"]),
        )
        if len(experience.head) == 0 or len(experience.gate) == 0:
            raise KVRuntimeError(f"{artifact.path}: the experience holds no head or no gate records")
        return experience


def table_advantage(
    table: torch.Tensor, records: Records, rewards: torch.Tensor, state_columns: tuple[str, ...], grid: torch.Tensor
) -> tuple[float, int]:
    """How much better a table's choices did than the actions tried on average, judged by experience records: in
    each state (a row of `state_columns` values) that holds a record of the table's action, the mean reward of those
    records minus the mean reward of all the state's records; averaged over such states. Random tables score about
    0; tables that learned the records' preferences score above it, on records they were not learned from too if
    the preferences are real. Returns (advantage, states counted)."""
    chosen = (grid[None, :] - table.reshape(-1, 1)).abs().argmin(dim=1)  # the table's action index per state
    state = torch.from_numpy(
        np.ravel_multi_index(tuple(records.column(c).numpy() for c in state_columns), tuple(table.shape))
    )
    actions = records.column("action")
    mine = actions == chosen[state]
    gains = []
    for index in state.unique().tolist():
        rows = state == index
        if bool((rows & mine).any()):
            gains.append(float(rewards[rows & mine].mean() - rewards[rows].mean()))
    return (sum(gains) / len(gains) if gains else 0.0), len(gains)
