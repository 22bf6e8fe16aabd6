"""Calibration statistics as sums over work items (needle probes, calibration prompts).

Each item adds its contribution into float64 sums; an `items_done` count says which items are in. So any split of
the items (the ranks of a process group, separate jobs merged later, a run and its resumption after a kill) adds
up to the sums of one uninterrupted run, and the artifact is finished from the sums alone (sums and counts, never
averages of averages). Every float sum carries its rounding error (`<name>.error`, Knuth's two-sum), so the sum is
exact to about 2^-106 whatever the order of the additions: splitting the items does not move a single bit of the
float32 artifact (plain float64 sums moved 13 of 2910 values by one float32 ulp on the default model). A run's
`settings` (model fingerprint, corpus hash, every option) travel with its checkpoints and partial statistics: sums
of other settings are never mixed in.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from kvcompile.calibration.checkpoint import load_checkpoint, save_checkpoint
from kvcompile.calibration.distributed import agree_on_settings, differing_settings, gather_dicts
from kvcompile.calibration.job import CompileJob
from kvcompile.calibration.shards import PARTIAL_KIND
from kvruntime import Artifact, KVRuntimeError
from kvruntime.artifacts.fingerprint import ModelFingerprint

DONE = "items_done"
ERROR = ".error"


@dataclasses.dataclass(frozen=True)
class StatisticsRun:
    kind: str  # the artifact kind the sums finish into
    model: ModelFingerprint  # the model the sums were measured on
    settings: dict[str, Any]  # everything the sums depend on besides the model (JSON-able)
    items: int
    provenance: dict[str, Any]

    @property
    def identity(self) -> dict[str, Any]:
        """What two runs must share for their sums to be added."""
        identity = {"kind": self.kind, "model": self.model.to_dict(), **self.settings, "items": self.items}
        return json.loads(json.dumps(identity, sort_keys=True))  # as stored: tuples become lists


# Builds the artifact from complete sums: (sums, run) -> artifact.
Finisher = Callable[[dict[str, torch.Tensor], StatisticsRun], Artifact]


def accumulate(
    run: StatisticsRun,
    sums: dict[str, torch.Tensor],
    add_item: Callable[[int, dict[str, torch.Tensor]], None],
    job: CompileJob,
    label: str,
    unit: str,
) -> dict[str, torch.Tensor]:
    """Run `add_item(item, sums)` over the job's share of the items, checkpointing every `job.checkpoint_every`
    items (beside `job.out`); returns the sums (over every rank when in a process group), with the `items_done`
    count. `label` and `unit` name the progress bar and its items."""
    shard, out = job.shard, job.out
    agree_on_settings(shard, run.identity)
    zeros = {**sums, DONE: torch.zeros(run.items, dtype=torch.int64)}
    sums = combine([zeros])
    identity = {**run.identity, "shard": shard.describe()}
    saved = load_checkpoint(out, identity, shard, job.resume)
    if saved is not None:
        sums = saved[0]
    todo = [item for item in shard.items(run.items) if not sums[DONE][item]]
    mine = len(shard.items(run.items))
    # Closed however the loop ends: an error's line starts on a line of its own, not after the bar.
    with tqdm(total=mine, initial=mine - len(todo), desc=label, unit=unit, disable=not shard.writes_results) as bar:
        for done, item in enumerate(todo, start=1):
            contribution = {name: torch.zeros_like(tensor) for name, tensor in zeros.items()}
            add_item(item, contribution)
            contribution[DONE][item] = 1
            sums = combine([sums, contribution])
            bar.update()
            if done % job.checkpoint_every == 0 and done < len(todo):
                save_checkpoint(out, sums, {"items_done": int(sums[DONE].sum())}, identity, shard)
    return combine(gather_dicts(shard, sums))


def combine(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The sums of `parts` in order, each float sum with its accumulated rounding error (`<name>.error`; a part
    without one has none)."""
    total = {name: tensor.clone() for name, tensor in parts[0].items()}
    for name, tensor in parts[0].items():
        if tensor.is_floating_point() and not name.endswith(ERROR):
            total.setdefault(name + ERROR, torch.zeros_like(tensor))
    for part in parts[1:]:
        for name, tensor in part.items():
            if name.endswith(ERROR):
                total[name] += tensor
            elif not tensor.is_floating_point():
                total[name] += tensor
            else:  # two-sum: s + e == a + b exactly
                a, s = total[name], total[name] + tensor
                b_virtual = s - a
                total[name + ERROR] += (a - (s - b_virtual)) + (tensor - b_virtual)
                total[name] = s
    return total


def resolved(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each sum with its rounding error added back: what the finishers read."""
    return {name: tensor + sums.get(name + ERROR, 0) for name, tensor in sums.items() if not name.endswith(ERROR)}


def finish_or_partial(
    run: StatisticsRun, sums: dict[str, torch.Tensor], shards: list[str], finish: Finisher
) -> Artifact:
    """The finished artifact when every item is in the sums once, else partial statistics (of `shards`, such as
    "1/4") for `kvcompile merge`."""
    if bool((sums[DONE] == 1).all()):
        return finish(resolved(sums), run)
    return partial_artifact(run, sums, shards)


def partial_artifact(run: StatisticsRun, sums: dict[str, torch.Tensor], shards: list[str]) -> Artifact:
    return Artifact(
        kind=PARTIAL_KIND,
        tensors=sums,
        model=run.model,
        provenance=run.provenance,
        params={"statistics_of": run.kind, "settings": run.settings, "items": run.items, "shards": shards},
    )


def run_of_partial(partial: Artifact) -> StatisticsRun:
    params = partial.params
    return StatisticsRun(
        kind=params["statistics_of"],
        model=partial.model,
        settings=params["settings"],
        items=params["items"],
        provenance=partial.provenance,
    )


def merge_partials(partials: list[Artifact], finishers: dict[str, Finisher]) -> Artifact:
    """Add the partial statistics of separate jobs: the finished artifact when they cover every item once, else
    a partial artifact covering their union. Partials of other models, kinds or settings are refused."""
    if len(partials) < 2:
        raise KVRuntimeError("merge needs at least two partial statistics")
    runs = [run_of_partial(p) for p in partials]
    for partial, run in zip(partials[1:], runs[1:]):
        if run.kind != runs[0].kind:
            raise KVRuntimeError(
                f"{partial.path} holds statistics of {run.kind!r}, {partials[0].path} of {runs[0].kind!r}: only "
                "statistics of one kind can be merged"
            )
        differing = differing_settings(run.identity, runs[0].identity)
        if differing:
            raise KVRuntimeError(f"{partial.path} cannot be merged with {partials[0].path}: they differ in {differing}")
    if runs[0].kind not in finishers:
        raise KVRuntimeError(f"{partials[0].path}: statistics of {runs[0].kind!r} cannot be merged")
    first = partials[0].tensors
    for partial in partials[1:]:
        if set(partial.tensors) != set(first) or any(partial.tensors[n].shape != first[n].shape for n in first):
            raise KVRuntimeError(f"{partial.path}: its tensors do not match those of {partials[0].path}")
    total = combine([p.tensors for p in partials])
    twice = torch.nonzero(total[DONE] > 1).flatten().tolist()
    if twice:
        raise KVRuntimeError(f"the partial statistics overlap: items {twice[:8]} are in more than one of them")
    run = runs[0]  # the same command's provenance: the merged artifact is what one run of it writes
    shards = [shard for p in partials for shard in p.params["shards"]]
    return finish_or_partial(run, total, shards, finishers[run.kind])
