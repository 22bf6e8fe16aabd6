"""Which share of the calibration work this process does, and how the shares meet again.

A compile run's work is a list of items (needle probes, calibration prompts). Shard i of n takes the items
i, i + n, i + 2n, ... The shards are either the ranks of a `torch.distributed` process group (started by `torchrun`),
whose sums are added over the group at the end, or separate jobs (`--shard i/n`), each writing partial statistics
that `kvcompile merge` adds up. Reductions run on the CPU with gloo, which every machine has; the statistics are
small and on the CPU anyway.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from kvcompile.calibration.shards import Shard, shard_from_text
from kvruntime import KVRuntimeError


def parse_shard(text: str | None) -> Shard:
    """`--shard i/n` of a separate job; None is the whole run (or this rank's share under torchrun)."""
    if text is None:
        return process_group_shard()
    shard = shard_from_text(text)
    if dist.is_initialized():
        raise KVRuntimeError("--shard is for separate jobs: under torchrun every rank takes its share by itself")
    return shard


def process_group_shard() -> Shard:
    """This rank's shard when started by torchrun (joining the process group once), else the whole run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    if not dist.is_initialized():
        return Shard()
    return Shard(dist.get_rank(), dist.get_world_size(), in_process_group=True)


def differing_settings(one: dict[str, Any], other: dict[str, Any]) -> str:
    """The keys whose values differ, comma-separated; a differing model fingerprint by its fields."""
    keys = [k for k in sorted(set(one) | set(other)) if one.get(k) != other.get(k)]
    return ", ".join(_model_fields(one[k], other[k]) if k == "model" and k in one and k in other else k for k in keys)


def _model_fields(one: Any, other: Any) -> str:
    if not isinstance(one, dict) or not isinstance(other, dict):
        return "model"
    return "model " + ", ".join(f for f in sorted(set(one) | set(other)) if one.get(f) != other.get(f))


def agree_on_settings(shard: Shard, settings: dict[str, Any]) -> None:
    """Refuse, on every rank, a process group whose ranks were started with different settings (or models, or
    corpora): their sums would add up to nothing meaningful."""
    everyone = gather_json(shard, settings)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            raise KVRuntimeError(
                f"the ranks disagree on the settings: rank {rank} differs from rank 0 in {differing_settings(other, everyone[0])} "
                "(start every rank with the same command, model and corpus)"
            )


def gather_dicts(shard: Shard, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every rank's tensors (same names and shapes on every rank), in rank order."""
    parts = {name: gather_tensors(shard, tensors[name]) for name in sorted(tensors)}
    ranks = len(next(iter(parts.values())))
    return [{name: parts[name][rank] for name in parts} for rank in range(ranks)]


def gather_tensors(shard: Shard, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor in rank order; their first dimensions may differ (the rest must agree)."""
    if not shard.in_process_group:
        return [tensor]
    tensor = tensor.detach().cpu().contiguous()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(shard.count)]
    dist.all_gather(lengths, torch.tensor([tensor.shape[0]]))
    longest = int(max(lengths))
    if longest == 0:
        return [tensor] * shard.count
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(shard.count)]
    dist.all_gather(parts, padded)
    return [part[: int(length)] for part, length in zip(parts, lengths)]


def gather_json(shard: Shard, value: Any) -> list[Any]:
    """Every rank's JSON-able `value`, in rank order. Sent as JSON text, never pickled: nothing a rank sends is
    executed on another."""
    data = torch.frombuffer(bytearray(json.dumps(value, sort_keys=True).encode()), dtype=torch.uint8)
    return [json.loads(bytes(part.tolist())) for part in gather_tensors(shard, data)]


def from_rank(shard: Shard, tensor: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """`rank`'s tensor (of the same shape and dtype everywhere) on every rank."""
    if shard.in_process_group:
        tensor = tensor.detach().cpu().contiguous().clone()
        dist.broadcast(tensor, src=rank)
    return tensor


def wait_for_all(shard: Shard) -> None:
    if shard.in_process_group:
        dist.barrier()
