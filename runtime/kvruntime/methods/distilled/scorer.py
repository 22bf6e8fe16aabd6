"""The distilled scorer's compiled weights and how the runtime reads them.

weights [layers, features, KV heads]: per layer, a linear map from a token's features (`features.py`) to the log of
the oracle's score for each KV head (ridge regression, `kvcompile distill`). layer_shares [ratios, layers] with
share_ratios [ratios] (scorers compiled since issue #33): the share of the kept cache each layer took in the
teacher's dynamic allocation of the calibration prompts, averaged, per ratio (`allocation="compiled"`).
lookahead_queries [n, hidden] (`kvcompile distill`): input embeddings whose attention over a prompt, fed after it,
was trained to match the same oracle; the runtime averages their log-scores with the student's, on the prompts
`lookahead_on` names (a param). They are compiled against this student and its model, so they live in its
artifact."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...artifacts.artifact import ArtifactReader
from ...errors import ArtifactError, short_repr
from ...requests.serving import compiled_ratios
from .features import feature_count
from .oracle import LOOKAHEAD_ON, MAX_LOOKAHEAD_QUERIES


@dataclasses.dataclass(frozen=True)
class DistilledScorer(ArtifactReader):
    kind = "distilled_scorer"
    weights: torch.Tensor  # [layers, features, KV heads]
    oracle: str  # what the scores were distilled from (the second pass `kvcompile distill` ran, `oracle.py`)
    task_prefix: tuple[int, ...] = ()  # the token ids that second pass fed before the copy of the context
    share_ratios: tuple[float, ...] = ()  # the ratios of `layer_shares`, increasing
    layer_shares: torch.Tensor | None = None  # [ratios, layers]: each layer's share of the kept cache
    share_floor: float = 0.25  # the floor the teacher's allocation gave every layer (every scorer before it: 0.25)
    lookahead_queries: torch.Tensor | None = None  # [n, hidden]: learned lookahead queries (`kvcompile distill`)
    lookahead_on: str = "all"  # the prompts they score (`LOOKAHEAD_ON`; every scorer before it: all)

    def __post_init__(self) -> None:
        self.check_schema({"weights": self.weights})
        if self.lookahead_on not in LOOKAHEAD_ON:
            raise ArtifactError(
                f"distilled scorer: lookahead_on {short_repr(self.lookahead_on)} is not one of {', '.join(LOOKAHEAD_ON)}"
            )
        if not 0.0 <= self.share_floor < 1.0:
            raise ArtifactError(f"distilled scorer: share_floor {self.share_floor!r} is not in [0, 1)")
        if self.lookahead_queries is not None:
            _check_lookahead_queries(self.lookahead_queries, self.weights.shape[1] - feature_count(0))
        if self.layer_shares is None:
            return
        layers = self.weights.shape[0]
        if tuple(self.layer_shares.shape) != (len(self.share_ratios), layers) or not self.share_ratios:
            raise ArtifactError(
                f"distilled scorer: layer_shares has shape {list(self.layer_shares.shape)}, expected "
                f"[{len(self.share_ratios)} ratios, {layers} layers]"
            )
        if any(b <= a for a, b in zip(self.share_ratios, self.share_ratios[1:])):
            raise ArtifactError(f"distilled scorer: share ratios {list(self.share_ratios)} are not increasing")
        if bool((self.layer_shares < 0).any()) or not torch.allclose(
            self.layer_shares.sum(dim=1), torch.ones(len(self.share_ratios), dtype=self.layer_shares.dtype), atol=1e-4
        ):
            raise ArtifactError("distilled scorer: each ratio's layer_shares must be non-negative and sum to 1")

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict[str, Any]) -> DistilledScorer:
        return cls(
            weights=tensors["weights"].float(),
            oracle=str(params.get("oracle", "unknown")),
            task_prefix=tuple(int(i) for i in params.get("task_prefix", ())),
            share_ratios=_share_ratios(tensors["share_ratios"]) if "share_ratios" in tensors else (),
            layer_shares=tensors["layer_shares"].double() if "layer_shares" in tensors else None,
            share_floor=_share_floor(params.get("share_floor", 0.25)),
            lookahead_queries=tensors["lookahead_queries"].float() if "lookahead_queries" in tensors else None,
            lookahead_on=params.get("lookahead_on", "all"),
        )


def _share_ratios(ratios: torch.Tensor) -> tuple[float, ...]:
    """The compiled ratios as a tuple: a list of numbers in (0, 1) (optional tensors are not in the kind's schema)."""
    if ratios.ndim != 1 or not ratios.is_floating_point() or not bool(((ratios > 0) & (ratios < 1)).all()):
        raise ArtifactError(
            f"distilled scorer: share_ratios must be a list of ratios in (0, 1), got {ratios.dtype} of shape "
            f"{list(ratios.shape)}"
        )
    return compiled_ratios(ratios.tolist())


def _check_lookahead_queries(queries: torch.Tensor, hidden_size: int) -> None:
    """[n, hidden] finite embeddings of the student's model width, 1 to MAX_LOOKAHEAD_QUERIES of them."""
    if queries.ndim != 2 or queries.shape[1] != hidden_size or not 1 <= queries.shape[0] <= MAX_LOOKAHEAD_QUERIES:
        raise ArtifactError(
            f"distilled scorer: lookahead_queries has shape {list(queries.shape)}, expected [1-{MAX_LOOKAHEAD_QUERIES} "
            f"queries, {hidden_size}]"
        )
    if not bool(torch.isfinite(queries).all()):
        raise ArtifactError("distilled scorer: lookahead_queries holds values that are not finite")


def _share_floor(value: object) -> float:
    """The recorded floor as a number: a file handed to us may hold anything there."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArtifactError(f"distilled scorer: share_floor {short_repr(value)} is not a number")
    return float(value)
