"""How much of CompilerKV's learned tables is signal: split-half stability, held-out advantage, and the reward's
signal-to-noise ratio, from the stored experience alone (no model run).

    python -m benchmarks.compilerkv.table_stability [--experience artifacts/.../compilerkv_tables.experience.safetensors]

Split half: both tables relearned from the records of two random halves of the calibration prompts
(`Experience.prompt_halves`; same learner and settings); agreement = share of entries, among states both halves have records for, where the two
tables hold the same action (or one within a grid step); chance = the agreement of two tables drawn independently
from the two halves' own action frequencies; kappa = (same - chance) / (1 - chance), Cohen's: 0 for agreement
by chance, 1 for tables that agree everywhere (where a design tries two actions per state chance is near 50%, so
kappa, not the ratio to chance, says how much of a table repeats). Held-out advantage (`table_advantage`): each half's table judged on
the other half's records (how much better its action did than the actions tried, in nats of continuation NLL),
against random tables of the same grid judged the same way (on each half, weighted alike). Signal vs noise: within one (prompt, state), the spread
of the paired rewards over the actions tried (what the learner must rank) against the spread of one (state,
action)'s reward over prompts.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.reporting import run_header
from kvcompile.recipe import artifact_folder
from kvcompile.recipes.compilerkv.bandit_experience import (
    GATE_ACTIONS,
    HEAD_ACTIONS,
    Experience,
    Records,
    table_advantage,
)
from kvcompile.recipes.compilerkv.settings import CQLSettings
from kvcompile.recipes.compilerkv.tables import learn_gate_table, learn_head_table
from kvruntime.artifacts.artifact import read_artifact

EXPERIENCE = artifact_folder("default") / "compilerkv_tables.experience.safetensors"


def _weighted(judged: list[tuple[float, int]]) -> float:
    """Advantages judged on several record sets, averaged with their records' counts as weights."""
    return sum(value * n for value, n in judged) / max(1, sum(n for _, n in judged))


def judge(experience: Experience, kind: str) -> tuple[Records, torch.Tensor]:
    """The records of one table and their rewards."""
    if kind == "head":
        return experience.head, experience.head_rewards()
    return experience.gate, experience.gate_rewards()


def agreement(a: torch.Tensor, b: torch.Tensor, seen: torch.Tensor, step: float) -> tuple[float, float]:
    same = (a == b)[seen].float().mean()
    near = ((a - b).abs() <= step + 1e-6)[seen].float().mean()
    return float(same), float(near)


def spreads(records: Records, rewards: torch.Tensor, state: tuple[str, ...]) -> tuple[float, float]:
    """Median over (prompt, state) of the reward range over actions; median over (state, action) of the reward
    standard deviation over prompts."""
    within: dict[tuple, list[float]] = {}
    across: dict[tuple, list[float]] = {}
    columns = {c: records.column(c).tolist() for c in ("prompt", "action", *state)}
    for i, reward in enumerate(rewards.tolist()):
        key = tuple(columns[c][i] for c in state)
        within.setdefault((columns["prompt"][i], *key), []).append(reward)
        across.setdefault((*key, columns["action"][i]), []).append(reward)
    ranges = [max(v) - min(v) for v in within.values() if len(v) > 1]
    deviations = [statistics.pstdev(v) for v in across.values() if len(v) > 1]
    return statistics.median(ranges), statistics.median(deviations) if deviations else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experience", type=Path, default=EXPERIENCE)
    parser.add_argument("--out", default="benchmarks/compilerkv/compilerkv_table_stability.md")
    args = parser.parse_args()
    artifact = read_artifact(args.experience)
    experience = Experience.from_artifact(artifact)
    params = artifact.params
    cql = CQLSettings(**params["cql"])
    layers, heads = artifact.model.num_layers, artifact.model.num_query_heads
    lines = [
        "# Stability of the learned CompilerKV tables (default model)",
        "",
        *run_header(),
        f"Experience: `{args.experience}` "
        f"({len(experience.head)} head and {len(experience.gate)} gate records on {len(experience.full_nll)} prompts).",
        "",
        "| table | states with records in both halves | same action | within one grid step | chance (same) | kappa | "
        "held-out advantage (states) | random tables' advantage (mean of 20) | "
        "reward range over actions, within a prompt (median) | reward std over prompts, per state and action (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    split = experience.prompt_halves()
    head = [learn_head_table(h, layers, heads, cql) for h in split]
    gate = [learn_gate_table(h, layers, params["entropy_bins"], params["perplexity_bins"], cql) for h in split]
    for table, learned, step, grid, whole, state in (
        ("W_head", head, 0.025, HEAD_ACTIONS, "head", ("budget", "layer", "head")),
        ("T_gate", gate, 0.01, GATE_ACTIONS, "gate", ("budget", "layer", "entropy_bin", "perplexity_bin")),
    ):
        seen = (learned[0].support > 0) & (learned[1].support > 0)
        same, near = agreement(learned[0].values, learned[1].values, seen, step)
        shares = [torch.stack([(t.values[seen] == a).float().mean() for a in grid]) for t in learned]
        chance = float((shares[0] * shares[1]).sum())
        judged = [table_advantage(learned[side].values, *judge(split[1 - side], whole), state, grid) for side in (0, 1)]
        held_out = _weighted(judged)
        g = torch.Generator().manual_seed(0)
        random = [
            _weighted(
                [
                    table_advantage(
                        grid[torch.randint(len(grid), seen.shape, generator=g)], *judge(h, whole), state, grid
                    )
                    for h in split
                ]
            )
            for _ in range(20)
        ]
        counted = sum(n for _, n in judged)
        within, across = spreads(*judge(experience, whole), state)
        lines.append(
            f"| {table} | {int(seen.sum())} of {seen.numel()} | {same:.1%} | {near:.1%} | {chance:.1%} | "
            f"{(same - chance) / (1 - chance):+.2f} | "
            f"{held_out:+.5f} ({counted}) | {statistics.mean(random):+.5f} | {within:.5f} | {across:.5f} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
