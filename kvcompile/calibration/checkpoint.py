"""Resumable compile runs: partial sums and progress written atomically next to the output, with the settings
they belong to, so that `--resume` continues only a run of the same model, data and settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvcompile.calibration.distributed import Shard, differing_settings
from kvruntime import KVRuntimeError
from kvruntime.artifacts.artifact import write_safetensors_atomically


def checkpoint_path(out: Path, shard: Shard = Shard()) -> Path:
    """`<out>.partial`; each rank of a process group has its own, `<out>.rank<i>of<n>.partial`."""
    rank = f".rank{shard.index}of{shard.count}" if shard.in_process_group else ""
    return out.with_name(f"{out.name}{rank}.partial")


def save_checkpoint(
    out: Path, tensors: dict[str, torch.Tensor], progress: dict[str, Any], settings: dict, shard: Shard = Shard()
) -> None:
    metadata = {"settings": json.dumps(settings, sort_keys=True), "progress": json.dumps(progress, sort_keys=True)}
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    write_safetensors_atomically(tensors, metadata, checkpoint_path(out, shard))


def load_checkpoint(
    out: Path, settings: dict, shard: Shard = Shard(), resume: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The saved state of an interrupted run with these settings; None when there is none, or without `resume`
    (a checkpoint left by an earlier run is then said to be started over, not dropped without a word)."""
    path = checkpoint_path(out, shard)
    if not path.exists():
        return None
    if not resume:
        print(
            f"note: starting over; the checkpoint {path} of an interrupted run will be replaced (--resume continues it)",
            file=sys.stderr,
        )
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        saved_settings = json.loads(metadata["settings"])
        progress = json.loads(metadata["progress"])
    except Exception:  # a damaged checkpoint is not resumable; say so rather than guess
        raise KVRuntimeError(f"checkpoint {path} is damaged: delete it and run without --resume") from None
    if saved_settings != json.loads(json.dumps(settings, sort_keys=True)):
        changed = differing_settings(saved_settings, json.loads(json.dumps(settings, sort_keys=True)))
        raise KVRuntimeError(f"checkpoint {path} belongs to a run with other settings ({changed} differ)")
    return tensors, progress


def discard_checkpoint(out: Path, shard: Shard = Shard()) -> None:
    checkpoint_path(out, shard).unlink(missing_ok=True)
