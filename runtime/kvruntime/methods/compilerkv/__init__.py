"""CompilerKV at run time: the method (`method.py`), its compiled tables (`tables.py`), the prompt signals it
measures (`signals.py`) and their math (`stabilized_utility.py`, `risk_gate.py`)."""

from ...serving import UTILITIES
from .method import CompilerKV
from .signals import WINDOW, LayerSignals, PromptSignals, layer_scores, layer_signals, prompt_signals
from .tables import CompilerKVTables

__all__ = [
    "UTILITIES",
    "WINDOW",
    "LayerSignals",
    "CompilerKV",
    "CompilerKVTables",
    "PromptSignals",
    "layer_scores",
    "layer_signals",
    "prompt_signals",
]
