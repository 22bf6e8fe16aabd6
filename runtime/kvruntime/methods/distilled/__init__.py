"""Distilled at run time: its registration (`spec.py`), the method (`method.py`), the compiled scorer's reader
(`scorer.py`) and the token features and predictions it shares with `kvcompile distill` (`features.py`)."""

from __future__ import annotations

from ...lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Distilled": "method",
        "DistilledScorer": "scorer",
        **dict.fromkeys(
            (
                "feature_count",
                "likeness_to_earlier",
                "oracle_targets",
                "predicted_scores",
                "running_state_sum",
                "token_features",
            ),
            "features",
        ),
    },
)
