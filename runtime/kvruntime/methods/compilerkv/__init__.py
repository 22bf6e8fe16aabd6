"""CompilerKV at run time: its registration (`spec.py`), the method (`method.py`), its compiled tables
(`tables.py`), the prompt signals it measures (`signals.py`) and their math (`stabilized_utility.py`,
`risk_gate.py`)."""

from __future__ import annotations

from ...lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CompilerKV": "method",
        "CompilerKVTables": "tables",
        **dict.fromkeys(
            ("LayerSignals", "PromptSignals", "layer_scores", "layer_signals", "prompt_signals"), "signals"
        ),
    },
)
