"""Resumable compile runs: partial sums and progress written atomically next to the output, with the settings
they belong to, so that `--resume` continues only a run of the same model, data and settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvruntime.artifact import write_safetensors_atomically
from kvruntime.errors import KVRuntimeError


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def save_checkpoint(out: Path, tensors: dict[str, torch.Tensor], progress: dict[str, Any], settings: dict) -> None:
    metadata = {"settings": json.dumps(settings, sort_keys=True), "progress": json.dumps(progress, sort_keys=True)}
    write_safetensors_atomically({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata, checkpoint_path(out))


def load_checkpoint(out: Path, settings: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The saved state of an interrupted run with these settings; None when there is none."""
    path = checkpoint_path(out)
    if not path.exists():
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
        changed = sorted(k for k in set(saved_settings) | set(settings) if saved_settings.get(k) != settings.get(k))
        raise KVRuntimeError(f"checkpoint {path} belongs to a run with other settings ({', '.join(changed)} differ)")
    return tensors, progress


def discard_checkpoint(out: Path) -> None:
    checkpoint_path(out).unlink(missing_ok=True)
