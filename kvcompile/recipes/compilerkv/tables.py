"""`kvcompile tables`: CompilerKV's head-reliability (W_head) and risk-threshold (T_gate) tables, learned as two
offline contextual bandits with Conservative Q-Learning, alternately: collect head experience under the current
gate and fit W_head, collect gate experience under the new W_head and fit T_gate, until the tables stop changing.

Each table is fitted on all of its experience so far, so the final tables are a function of the stored experience
alone: `relearn_tables` reproduces them from the experience artifact without the model.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch
from tqdm.auto import tqdm

from kvcompile.calibration.checkpoint import load_checkpoint, save_checkpoint
from kvcompile.calibration.corpus import Corpus, calibration_prompts
from kvcompile.calibration.distributed import (
    Shard,
    agree_on_settings,
    from_rank,
    gather_dicts,
    gather_json,
    gather_tensors,
)
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.provenance import provenance
from kvcompile.recipes.compilerkv.bandit_experience import (
    GATE_ACTIONS,
    GATE_COLUMNS,
    HEAD_ACTIONS,
    HEAD_COLUMNS,
    HEAD_FALLBACK,
    Experience,
    Records,
    gate_fallback,
)
from kvcompile.recipes.compilerkv.experience_collection import (
    SelectionRule,
    collect_unit,
    greedy_continuation,
    prefill_prompt,
    prefill_with_signals,
    probed_states,
    stratified_choice,
)
from kvcompile.recipes.compilerkv.offline_cql import (
    GreedyTable,
    fit_greedy_table,
    gate_state_features,
    head_state_features,
)
from kvcompile.recipes.compilerkv.settings import WINDOW, CQLSettings, TablesSettings
from kvruntime import Artifact, KVRuntimeError, model_fingerprint
from kvruntime.artifacts.fingerprint import ModelFingerprint
from kvruntime.methods.compilerkv.risk_gate import quantile_edges, risk_bin

PHASES = ("head", "gate")


@dataclasses.dataclass
class LearnedTable:
    values: torch.Tensor
    support: torch.Tensor  # experience records per state
    learning_curve: list[float]
    reward_scale: float


def learn_head_table(experience: Experience, num_layers: int, num_heads: int, cql: CQLSettings) -> LearnedTable:
    """W_head [budgets, layers, heads]: the greedy weight of each state; states without records keep 1.0."""
    sizes = (len(experience.budgets), num_layers, num_heads)
    values, support, fit = _greedy_table(
        experience.head,
        ("budget", "layer", "head"),
        sizes,
        head_state_features,
        experience.head_rewards(),
        HEAD_ACTIONS,
        cql,
    )
    values = torch.where(support > 0, values, torch.tensor(HEAD_FALLBACK))
    return LearnedTable(values, support, fit.learning_curve, fit.reward_scale)


def learn_gate_table(
    experience: Experience, num_layers: int, entropy_bins: int, perplexity_bins: int, cql: CQLSettings
) -> LearnedTable:
    """T_gate [budgets, layers, entropy bins, perplexity bins]: the greedy threshold of every cell of a
    (budget, layer) with records (cells without their own prompts are read off the Q-function between their
    neighbours); a (budget, layer) without records keeps `gate_fallback`."""
    sizes = (len(experience.budgets), num_layers, entropy_bins, perplexity_bins)
    values, support, fit = _greedy_table(
        experience.gate,
        ("budget", "layer", "entropy_bin", "perplexity_bin"),
        sizes,
        gate_state_features,
        experience.gate_rewards(),
        GATE_ACTIONS,
        cql,
    )
    layer_seen = support.sum(dim=(2, 3), keepdim=True) > 0
    values = torch.where(layer_seen, values, torch.tensor(gate_fallback(experience.elastic)))
    return LearnedTable(values, support, fit.learning_curve, fit.reward_scale)


def _greedy_table(
    records: Records,
    state_columns: tuple[str, ...],
    sizes: tuple[int, ...],
    features,
    rewards: torch.Tensor,
    action_grid: torch.Tensor,
    cql: CQLSettings,
) -> tuple[torch.Tensor, torch.Tensor, GreedyTable]:
    """Fit on the records and read the greedy action's value for every state of the grid `sizes`; also the number
    of records per state."""
    columns = [records.column(c).numpy() for c in state_columns]
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in sizes], indexing="ij"), axis=-1).reshape(-1, len(sizes))
    fit = fit_greedy_table(
        features(*columns, sizes),
        records.column("action").numpy(),
        rewards.numpy(),
        len(action_grid),
        features(*grid.T, sizes),
        cql,
    )
    flat = np.ravel_multi_index(tuple(columns), sizes)
    support = torch.from_numpy(np.bincount(flat, minlength=int(np.prod(sizes))).reshape(sizes))
    return action_grid[torch.from_numpy(fit.actions)].view(sizes), support, fit


def risk_edges(experience: Experience, entropy_bins: int, perplexity_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bins' edges: quantiles of the candidate prompts' risks (the chosen ones over-sample thin strata)."""
    risks = experience.candidate_risks
    return quantile_edges(risks[:, 0], entropy_bins), quantile_edges(risks[:, 1], perplexity_bins)


def compile_tables(job: CompileJob, corpus: Corpus, settings: TablesSettings) -> tuple[Artifact, Artifact]:
    """Collect experience and learn both tables; returns the tables and the experience artifacts.

    In a process group each rank prefills and probes its own share of the prompts; before every fit the ranks
    pool their records (in the order one process would have made them), and every rank continues with rank 0's
    table."""
    settings.check()
    shard = job.shard
    fingerprint = model_fingerprint(job.model)
    if fingerprint.num_query_heads % fingerprint.num_kv_heads:
        raise KVRuntimeError("query heads must be a multiple of KV heads")
    checkpoint_settings = {
        "model": fingerprint.to_dict(),
        "corpus_sha256": corpus.sha256,
        "settings": settings.to_dict(),
    }
    agree_on_settings(shard, checkpoint_settings)
    experience, prompts, edges = _chosen_prompts(job, corpus, settings)
    layers, heads = fingerprint.num_layers, fingerprint.num_query_heads
    units = [(p, b) for p in prompts for b in range(len(settings.budgets))]  # this rank's, in its order
    run = _starting_run(job, settings, checkpoint_settings, layers, heads, len(units))
    learned: dict[str, LearnedTable] = {}
    converged = False

    def pool_records() -> None:
        experience.head, experience.gate = (
            pooled_records(shard, run.own_records[kind], settings.prompts, len(settings.budgets)) for kind in PHASES
        )

    progress = run.progress
    for round_ in range(progress["round"], settings.rounds):
        if round_ > progress["round"]:
            run.round_start = {name: table.clone() for name, table in run.state.items()}
        for phase in range(progress["phase"] if round_ == progress["round"] else 0, len(PHASES)):
            kind = PHASES[phase]
            first_unit = progress["unit"] if (round_, phase) == (progress["round"], progress["phase"]) else 0
            _collect_phase(job, settings, run, prompts, units, round_, phase, first_unit)
            pool_records()
            learned[kind] = _learn(kind, experience, layers, heads, settings)
            learned[kind].values = from_rank(shard, learned[kind].values)
            run.state["head_reliability" if kind == "head" else "risk_thresholds"] = learned[kind].values
            run.history[f"{kind}_curves"].append(learned[kind].learning_curve)
            run.save(round_, phase + 1, 0)
        changes = [float((run.state[name] != run.round_start[name]).float().mean()) for name in run.state]
        run.history["changes"].append(changes)
        run.save(round_ + 1, 0, 0)
        if round_ > 0 and max(changes) < settings.tolerance:
            converged = True
            break
    pool_records()
    for kind in PHASES:  # a table fitted before an interruption: the same fit again (deterministic)
        if kind not in learned:
            learned[kind] = _learn(kind, experience, layers, heads, settings)
    params = {**_params(settings, experience), "rounds_run": len(run.history["changes"]), "converged": converged}
    source = provenance(corpus, settings.seed)
    experience_artifact = Artifact(
        kind="compilerkv_experience",
        tensors=experience.tensors(),
        model=fingerprint,
        provenance=source,
        params=params,
    )
    tables = tables_artifact(fingerprint, experience, learned, run.history, edges, source, params)
    return tables, experience_artifact


def _chosen_prompts(
    job: CompileJob, corpus: Corpus, settings: TablesSettings
) -> tuple[Experience, dict[int, object], tuple[torch.Tensor, torch.Tensor]]:
    """The calibration prompts chosen by their risk (stratified), this rank's share of them prefilled and placed in
    their risk bins, the experience they start (no records yet) and the bins' edges."""
    model, shard = job.model, job.shard
    calibration = calibration_prompts(
        corpus, job.tokenizer, settings.candidates, settings.context_tokens + settings.continuation, settings.seed
    )
    candidate_risks = torch.zeros(settings.candidates, 2, dtype=torch.float64)
    for index in tqdm(shard.items(settings.candidates), desc="risk of candidate prompts", unit="prompt"):
        signals, _, _ = prefill_with_signals(model, calibration[index][1], settings.context_tokens)
        candidate_risks[index] = torch.tensor([signals.entropy, signals.perplexity])
    candidate_risks = sum(part["risks"] for part in gather_dicts(shard, {"risks": candidate_risks}))
    chosen = stratified_choice(candidate_risks, settings.prompts, settings.strata, settings.seed)

    def scored_text(index: int) -> torch.Tensor:
        ids = calibration[chosen[index]][1]
        if settings.continuation_from == "greedy":
            return greedy_continuation(model, ids, settings.context_tokens, settings.continuation)
        return ids

    prompts = {
        index: prefill_prompt(model, scored_text(index), settings.context_tokens, index)
        for index in tqdm(list(shard.items(settings.prompts)), desc="prefill chosen prompts", unit="prompt")
    }
    signals = torch.zeros(settings.prompts, 3, dtype=torch.float64)  # full NLL, entropy, perplexity
    for index, prompt in prompts.items():
        signals[index] = torch.tensor([prompt.full_nll, prompt.signals.entropy, prompt.signals.perplexity])
    signals = sum(part["signals"] for part in gather_dicts(shard, {"signals": signals}))  # one rank fills each row
    experience = Experience(
        head=Records(HEAD_COLUMNS),
        gate=Records(GATE_COLUMNS),
        full_nll=signals[:, 0].clone(),
        entropy=signals[:, 1].clone(),
        perplexity=signals[:, 2].clone(),
        candidate_risks=candidate_risks,
        chosen=torch.tensor(chosen),
        budgets=settings.budgets,
        context_tokens=settings.context_tokens,
        penalty=settings.penalty,
        elastic=settings.elastic,
    )
    edges = risk_edges(experience, settings.entropy_bins, settings.perplexity_bins)
    for prompt in prompts.values():
        prompt.entropy_bin = risk_bin(prompt.signals.entropy, edges[0])
        prompt.perplexity_bin = risk_bin(prompt.signals.perplexity, edges[1])
    return experience, prompts, edges


@dataclasses.dataclass
class _Run:
    """Where the rounds stand: the tables now and at the round's start, this rank's own records (the pooled ones,
    `Experience.head` and `.gate`, are rebuilt before every fit), the progress and the learning history."""

    state: dict[str, torch.Tensor]
    round_start: dict[str, torch.Tensor]
    own_records: dict[str, Records]
    progress: dict
    history: dict[str, list]
    job: CompileJob  # where the checkpoint goes, and the ranks
    checkpoint_settings: dict

    def save(self, round_: int, phase: int, unit: int) -> None:
        tensors = {
            **self.own_records["head"].tensors("head"),
            **self.own_records["gate"].tensors("gate"),
            **self.state,
            **{f"round_start_{name}": table for name, table in self.round_start.items()},
        }
        progress = {"round": round_, "phase": phase, "unit": unit, "history": self.history}
        save_checkpoint(self.job.out, tensors, progress, self.checkpoint_settings, self.job.shard)


def _starting_run(
    job: CompileJob, settings: TablesSettings, checkpoint_settings: dict, layers: int, heads: int, units: int
) -> _Run:
    """The run from its start, or from its checkpoint (`--resume`), caught up with the other ranks."""
    shape_gate = (len(settings.budgets), layers, settings.entropy_bins, settings.perplexity_bins)
    state = {
        "head_reliability": torch.full((len(settings.budgets), layers, heads), HEAD_FALLBACK),
        "risk_thresholds": torch.full(shape_gate, gate_fallback(settings.elastic)),
    }
    history: dict[str, list] = {"head_curves": [], "gate_curves": [], "changes": []}
    progress = {"round": 0, "phase": 0, "unit": 0, "history": history}
    round_start = {name: table.clone() for name, table in state.items()}
    own_records = {kind: Records(experience_columns(kind)) for kind in PHASES}
    saved = load_checkpoint(job.out, checkpoint_settings, job.shard, job.resume)
    if saved is not None:
        tensors, progress = saved
        own_records = {kind: Records.from_tensors(experience_columns(kind), tensors, kind) for kind in PHASES}
        state = {name: tensors[name] for name in state}
        round_start = {name: tensors[f"round_start_{name}"] for name in state}
        history = progress["history"]
    if job.shard.in_process_group:
        progress, state, round_start, history = _catch_up(job.shard, progress, state, round_start, units)
    return _Run(state, round_start, own_records, progress, history, job, checkpoint_settings)


def _collect_phase(
    job: CompileJob,
    settings: TablesSettings,
    run: _Run,
    prompts: dict[int, object],
    units: list[tuple[int, int]],
    round_: int,
    phase: int,
    first_unit: int,
) -> None:
    """One phase's experience: every (prompt, budget) unit of this rank from `first_unit` on, probed under the
    tables now, each saved in the checkpoint once collected."""
    kind, fingerprint = PHASES[phase], model_fingerprint(job.model)
    desc = f"round {round_ + 1}/{settings.rounds}: {kind} experience"
    bar = tqdm(total=len(units), initial=first_unit, desc=desc, unit="unit")
    for unit in range(first_unit, len(units)):
        prompt_index, budget_index = units[unit]
        prompt = prompts[prompt_index]
        global_unit = prompt_index * len(settings.budgets) + budget_index  # the unit's seeds: shard-free
        probed = probed_states(
            kind, global_unit, fingerprint.num_layers, fingerprint.num_kv_heads, settings.design, settings.seed, round_
        )
        collect_unit(
            job.model,
            prompt,
            run.state["head_reliability"][budget_index],
            run.state["risk_thresholds"][budget_index, :, prompt.entropy_bin, prompt.perplexity_bin],
            budget_index,
            settings.budgets[budget_index],
            SelectionRule(settings.elastic, settings.utility),
            kind,
            probed,
            settings.design,
            random.Random(f"{settings.seed}:{round_}:{kind}:{global_unit}"),
            round_,
            run.own_records[kind],
            settings.batch_size,
            settings.loss,
        )
        bar.update()
        bar.set_postfix(records=len(run.own_records[kind]))
        run.save(round_, phase, unit + 1)
    bar.close()


def experience_columns(kind: str) -> tuple[str, ...]:
    return HEAD_COLUMNS if kind == "head" else GATE_COLUMNS


def pooled_records(shard: Shard, own: Records, prompts: int, budgets: int) -> Records:
    """Every rank's records in the order one process makes them: by round, prompt and budget, and within a
    (prompt, budget) unit in the order they were made (all by one rank)."""
    columns = {name: torch.cat(gather_tensors(shard, own.column(name))) for name in own.columns}
    unit_order = (columns["round"] * prompts + columns["prompt"]) * budgets + columns["budget"]
    order = torch.sort(unit_order, stable=True).indices
    return Records(own.columns, {name: column[order] for name, column in columns.items()})


def _catch_up(
    shard: Shard, progress: dict, state: dict[str, torch.Tensor], round_start: dict[str, torch.Tensor], own_units: int
) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Ranks killed together may have saved one step apart: one saved after the fit every rank took part in,
    another had finished its units but not yet saved the fit. The laggards take the leader's tables and step."""
    everyone = gather_json(shard, progress)
    steps = [p["round"] * (len(PHASES) + 1) + p["phase"] for p in everyone]
    leader = max(range(shard.count), key=lambda rank: steps[rank])
    step = steps[shard.index]
    if all(s == steps[leader] for s in steps):
        return progress, state, round_start, progress["history"]
    finished = progress["phase"] == len(PHASES) or progress["unit"] == own_units
    if any(s < steps[leader] - 1 for s in steps) or (step < steps[leader] and not finished):
        raise KVRuntimeError(
            "the ranks' checkpoints are more than one step apart: resume with the same number of ranks as the "
            "interrupted run, or start over without --resume"
        )
    state = {name: from_rank(shard, table, leader) for name, table in state.items()}
    round_start = {name: from_rank(shard, table, leader) for name, table in round_start.items()}
    return everyone[leader], state, round_start, everyone[leader]["history"]


def _learn(kind: str, experience: Experience, layers: int, heads: int, settings: TablesSettings) -> LearnedTable:
    if kind == "head":
        return learn_head_table(experience, layers, heads, settings.cql)
    return learn_gate_table(experience, layers, settings.entropy_bins, settings.perplexity_bins, settings.cql)


def _params(settings: TablesSettings, experience: Experience) -> dict:
    return {
        **settings.to_dict(),
        "context_tokens": experience.context_tokens,
        "penalty": experience.penalty,
        "window": WINDOW,
        "head_actions": HEAD_ACTIONS.tolist(),
        "gate_actions": GATE_ACTIONS.tolist(),
        "head_records": len(experience.head),
        "gate_records": len(experience.gate),
    }


def tables_artifact(
    fingerprint: ModelFingerprint,
    experience: Experience,
    learned: dict[str, LearnedTable],
    history: dict,
    edges: tuple[torch.Tensor, torch.Tensor],
    source: dict,
    params: dict,
) -> Artifact:
    return Artifact(
        kind="compilerkv_tables",
        tensors={
            "budgets": torch.tensor(experience.budgets),
            "head_reliability": learned["head"].values.float(),
            "risk_thresholds": learned["gate"].values.float(),
            "entropy_edges": edges[0],
            "perplexity_edges": edges[1],
            "head_support": learned["head"].support,
            "gate_support": learned["gate"].support,
            "head_learning_curve": torch.tensor(history["head_curves"], dtype=torch.float32),
            "gate_learning_curve": torch.tensor(history["gate_curves"], dtype=torch.float32),
            "round_changes": torch.tensor(history["changes"], dtype=torch.float32).view(-1, 2),
        },
        model=fingerprint,
        provenance=source,
        params={
            **params,
            "reward_scale": {"head": learned["head"].reward_scale, "gate": learned["gate"].reward_scale},
        },
    )


def relearn_tables(experience_artifact: Artifact) -> Artifact:
    """The tables learned from stored experience alone, with the settings it was collected with."""
    experience = Experience.from_artifact(experience_artifact)
    params = experience_artifact.params
    cql = CQLSettings(**params["cql"])
    settings = dataclasses.replace(
        TablesSettings(), cql=cql, entropy_bins=params["entropy_bins"], perplexity_bins=params["perplexity_bins"]
    )
    fingerprint = experience_artifact.model
    learned = {
        kind: _learn(kind, experience, fingerprint.num_layers, fingerprint.num_query_heads, settings) for kind in PHASES
    }
    history = {
        "head_curves": [learned["head"].learning_curve],
        "gate_curves": [learned["gate"].learning_curve],
        "changes": [],
    }
    source = {**experience_artifact.provenance, "relearned_from": str(experience_artifact.path)}
    return tables_artifact(
        fingerprint,
        experience,
        learned,
        history,
        risk_edges(experience, settings.entropy_bins, settings.perplexity_bins),
        source,
        params,
    )


def describe_tables(artifact: Artifact) -> str:
    """A few lines on what was learned: how far each table is from flat, and how the rounds went."""
    t = artifact.tensors
    heads, gate = t["head_reliability"], t["risk_thresholds"]
    changes = t["round_changes"].tolist()
    return "\n".join(
        [
            f"W_head: {int((heads != 1.0).sum())} of {heads.numel()} entries away from 1.0, range "
            f"{float(heads.min()):.3f}-{float(heads.max()):.3f}; states with records: "
            f"{int((t['head_support'] > 0).sum())} of {heads.numel()}",
            f"T_gate: {len(gate.unique())} distinct thresholds, range {float(gate.min()):.3f}-{float(gate.max()):.3f}; "
            f"cells with records: {int((t['gate_support'] > 0).sum())} of {gate.numel()}",
            "share of entries changed per round (head, gate): "
            + (", ".join(f"({h:.2f}, {g:.2f})" for h, g in changes) or "relearned from experience"),
        ]
    )
