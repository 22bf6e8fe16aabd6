"""A distilled scorer written as a KVzap checkpoint, so that kvpress's own `KVzapPress` (and `DMSPress` around it)
runs a scorer compiled by `kvcompile distill --student hidden` (KVzap's linear student: per layer, a linear map
of the attention input to the log-score of each KV head).

kvpress loads it with `KVzapModel.from_pretrained(folder)`: `config.json` (KVzapConfig: input_dim, output_dim,
n_modules, hidden_dim None for the linear model) and `model.safetensors` with `layers.{i}.weight` [Hkv, hidden]
and `layers.{i}.bias` [Hkv]. Written without kvpress installed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvruntime import Artifact, KVRuntimeError
from kvruntime.files import replace_folder
from kvruntime.methods.distilled import feature_count, student_features


def kvzap_tensors(scorer: Artifact) -> dict[str, torch.Tensor]:
    """The scorer's weights [L, F, Hkv] as KVzap's per-layer linear modules; refused unless it reads only the
    attention input and the bias (a student distilled with `--student hidden`)."""
    weights = scorer.tensors["weights"]
    hidden_size = weights.shape[1] - feature_count(0)
    read = student_features(hidden_size, "hidden")
    unread = torch.ones(weights.shape[1], dtype=torch.bool)
    unread[read] = False
    if bool(weights[:, unread].abs().gt(0).any()):
        raise KVRuntimeError(
            "this distilled_scorer reads position and likeness features that KVzap's model cannot: "
            "distil one with `kvcompile distill --student hidden`"
        )
    tensors = {}
    for layer in range(weights.shape[0]):
        tensors[f"layers.{layer}.weight"] = weights[layer, :hidden_size].T.contiguous().float()
        tensors[f"layers.{layer}.bias"] = weights[layer, hidden_size].contiguous().float()
    return tensors


def write_kvzap_checkpoint(scorer: Artifact, folder: Path) -> Path:
    """Write the checkpoint folder (atomically: a complete folder or none)."""
    tensors = kvzap_tensors(scorer)
    layers, (heads, hidden_size) = len(tensors) // 2, tensors["layers.0.weight"].shape
    config = {
        "model_type": "kvzap",
        "architectures": ["KVzapModel"],
        "input_dim": hidden_size,
        "output_dim": heads,
        "n_modules": layers,
        "hidden_dim": None,
        "kvcompile": {"oracle": scorer.params.get("oracle"), "model": dataclasses.asdict(scorer.model)},
    }

    def write(staging: Path) -> None:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})

    return replace_folder(folder, write)
