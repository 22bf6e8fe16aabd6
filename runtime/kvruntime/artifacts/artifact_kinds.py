"""Every artifact kind in one place: what its tensors must be, the command that compiles it, and the class the
runtime reads it into. The artifact loader checks tensors against `tensors`, method construction and the command
line's messages name `command`, and `kvcompile`'s recipes write `name`. Torch-free: the command line reads it
before it imports anything heavy.

A tensor rule is (values, shape[, value rule]): values "integer" or "numeric"; each size in a shape a number, a size
of the artifact's model (layers, query_heads, kv_heads), or a name: any size of at least 1, the same in every tensor
of the artifact ("name-1": one less than it). Only the tensors the runtime reads are listed.
"""

from __future__ import annotations

import dataclasses

from ..errors import KVRuntimeError


@dataclasses.dataclass(frozen=True)
class ArtifactKind:
    name: str
    command: str  # the command that compiles it ("" for kinds no command writes on its own)
    tensors: dict[str, tuple] = dataclasses.field(default_factory=dict)
    # Resampled over relative depth, so that it may serve a model with another layer count (with force, like another
    # checkpoint); every other shape difference is always refused.
    depth_portable: bool = False


ARTIFACT_KINDS: dict[str, ArtifactKind] = {
    kind.name: kind
    for kind in (
        ArtifactKind(
            "srh_heads",
            "kvcompile heads",
            {"srh_score": ("numeric", ("layers", "query_heads"))},
        ),
        ArtifactKind(
            "layer_budgets",
            "kvcompile layer-errors",
            {"layer_error": ("numeric", ("layers",), "non-negative with a positive sum")},
        ),
        ArtifactKind(
            "compilerkv_tables",
            "kvcompile tables",
            {
                "budgets": ("integer", ("budgets",)),
                "head_reliability": ("numeric", ("budgets", "layers", "query_heads")),
                "risk_thresholds": ("numeric", ("budgets", "layers", "entropy_bins", "perplexity_bins")),
                "entropy_edges": ("numeric", ("entropy_bins-1",)),
                "perplexity_edges": ("numeric", ("perplexity_bins-1",)),
            },
            depth_portable=True,
        ),
        ArtifactKind(
            "compilerkv_experience",  # the rollouts `kvcompile tables` learned from (`--from-experience` relearns)
            "kvcompile tables",
            {
                "budgets": ("integer", ("budgets",)),
                **{f"prompt_{name}": ("numeric", ("prompts",)) for name in ("full_nll", "entropy", "perplexity")},
                "prompt_candidate": ("integer", ("prompts",)),
                "candidate_risks": ("numeric", ("candidates", 2)),
            },
        ),
        ArtifactKind(
            "kvcompose_stats",
            "kvcompile stats",
            {
                "ratios": ("numeric", ("ratios",)),
                "layer_fractions": ("numeric", ("ratios", "layers")),
                "head_fractions": ("numeric", ("ratios", "layers", "kv_heads")),
            },
        ),
        ArtifactKind(
            "tuned_defaults",
            "kvcompile tune",
            {"full_accuracy": ("numeric", (1,))},
        ),
        ArtifactKind(
            "distilled_scorer",
            "kvcompile distill",
            {"weights": ("numeric", ("layers", "features", "kv_heads"))},
        ),
        # Sums of a share of a compile run (`--shard`), for `kvcompile merge`; never applied to a model.
        ArtifactKind("partial_statistics", ""),
        # A document's compressed cache (`kvcompile generate --save-context`), answered from later; its tensors,
        # per layer, are checked by `context_file.py` against the model it names.
        ArtifactKind("compressed_context", "kvcompile generate"),
    )
}
KNOWN_KINDS = tuple(ARTIFACT_KINDS)


def artifact_kind(name: str) -> ArtifactKind:
    if name not in ARTIFACT_KINDS:
        raise KVRuntimeError(f"unknown artifact kind {name!r} (known: {', '.join(KNOWN_KINDS)})")
    return ARTIFACT_KINDS[name]
