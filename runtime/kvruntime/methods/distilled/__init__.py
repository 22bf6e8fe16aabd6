"""Distilled at run time: its registration (`spec.py`), the method (`method.py`), the compiled scorer's reader
(`scorer.py`), what it was distilled from (`oracle.py`) and the token features and predictions it shares with
`kvcompile distill` (`features.py`), and the key-geometry term mixed into its scores (`leverage.py`)."""

from __future__ import annotations

from ...lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Distilled": "method",
        "DistilledScorer": "scorer",
        **dict.fromkeys(
            (
                "extra_features",
                "feature_count",
                "likeness_to_earlier",
                "predicted_scores",
                "predicted_token_scores",
                "running_state_sum",
                "student_features",
                "token_features",
            ),
            "features",
        ),
        **dict.fromkeys(("key_leverage", "with_leverage"), "leverage"),
        **dict.fromkeys(("ORACLES", "PREFIXED", "oracle_scores", "oracle_targets", "second_pass_target"), "oracle"),
    },
)
