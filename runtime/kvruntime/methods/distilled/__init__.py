"""Distilled at run time: the method (`method.py`), the compiled scorer's reader (`scorer.py`) and the token
features and predictions it shares with `kvcompile distill` (`features.py`)."""

from .features import oracle_targets, predicted_scores, token_features
from .method import Distilled
from .scorer import DistilledScorer

__all__ = ["Distilled", "DistilledScorer", "oracle_targets", "predicted_scores", "token_features"]
