"""The method and ratio `kvcompile tune` recommends for a model, read from its `tuned_defaults` artifact: the
runtime's default when `compress` is given no method.

The artifact also names the artifacts the recommended method needs (file names, looked up beside it, in its bundle
if it is in one)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .artifact import Artifact, check_kind
from .bundle import beside
from .errors import ArtifactError, KVRuntimeError


@dataclasses.dataclass(frozen=True)
class TunedDefaults:
    method: str
    options: dict
    ratio: float
    accuracy: float
    full_accuracy: float
    tolerance: float
    artifact_files: tuple[Path, ...]

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> TunedDefaults:
        check_kind(artifact, "tuned_defaults")
        recommended = artifact.params.get("recommended")
        if recommended is None:
            raise KVRuntimeError(
                f"{artifact.path}: tuning found no method within {artifact.params.get('tolerance')} of the full cache's "
                "accuracy at any ratio tried; pass a method and ratio, or tune with a larger tolerance or smaller ratios"
            )
        try:
            path = artifact.path if artifact.path is not None else Path("tuned_defaults")
            return cls(
                method=str(recommended["method"]),
                options=dict(recommended["options"]),
                ratio=float(recommended["ratio"]),
                accuracy=float(recommended["accuracy"]),
                full_accuracy=float(artifact.tensors["full_accuracy"][0]),
                tolerance=float(artifact.params["tolerance"]),
                artifact_files=tuple(beside(path, recommended["artifacts"], "its recommendation")),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ArtifactError(f"{artifact.path}: malformed tuned_defaults ({exc})") from None
