"""The method and ratio `kvcompile tune` recommends for a model, read from its `tuned_defaults` artifact: the
runtime's default when `compress` is given no method, and `kvcompile generate`'s, resolved before torch loads from
the artifact's header (`from_params`).

The artifact also names the artifacts the recommended method needs (file names, looked up beside it, in its bundle
if it is in one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ArtifactError, KVRuntimeError
from .bundle import beside

if TYPE_CHECKING:
    from .artifact import Artifact


@dataclasses.dataclass(frozen=True)
class TunedDefaults:
    method: str
    options: dict
    ratio: float
    accuracy: float
    tolerance: float
    artifact_files: tuple[Path, ...]

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: Path) -> TunedDefaults:
        """The recommendation in a tuned_defaults artifact's params (torch-free: `artifact_header.header_params`);
        `path` is the artifact's, beside which its method's artifacts are found."""
        recommended = params.get("recommended")
        if recommended is None:
            raise KVRuntimeError(
                f"{path}: tuning found no method within {params.get('tolerance')} of the full cache's "
                "accuracy at any ratio tried; pass a method and ratio, or tune with a larger tolerance or smaller ratios"
            )
        try:
            return cls(
                method=str(recommended["method"]),
                options=dict(recommended["options"]),
                ratio=float(recommended["ratio"]),
                accuracy=float(recommended["accuracy"]),
                tolerance=float(params["tolerance"]),
                artifact_files=tuple(beside(path, recommended["artifacts"], "its recommendation")),
            )
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ArtifactError(f"{path}: malformed tuned_defaults ({exc})") from None

    def completed(
        self, options: Mapping[str, object], ratio: float | None, budget: int | None
    ) -> tuple[str, dict, float | None]:
        """The method, options and ratio of a request that named no method: the options given join the tuned
        method's own (the given ones win), and the tuned ratio applies unless a ratio or a budget was given."""
        given = ratio is not None or budget is not None
        return self.method, {**self.options, **options}, ratio if given else self.ratio

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> TunedDefaults:
        from .artifact import check_kind

        check_kind(artifact, "tuned_defaults")
        return cls.from_params(artifact.params, artifact.path if artifact.path is not None else Path("tuned_defaults"))
