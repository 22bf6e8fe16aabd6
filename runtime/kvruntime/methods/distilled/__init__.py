"""Distilled at run time: the method (`method.py`), the compiled scorer's reader (`scorer.py`) and the token
features and predictions it shares with `kvcompile distill` (`features.py`)."""

from .features import (
    feature_count,
    likeness_to_earlier,
    oracle_targets,
    predicted_scores,
    running_state_sum,
    token_features,
)
from .method import Distilled
from .scorer import DistilledScorer

__all__ = [
    "Distilled",
    "DistilledScorer",
    "feature_count",
    "likeness_to_earlier",
    "oracle_targets",
    "predicted_scores",
    "running_state_sum",
    "token_features",
]
