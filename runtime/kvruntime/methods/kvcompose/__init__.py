"""KVCompose at run time: its registration (`spec.py`), the method (`method.py`), its compiled statistics
(`stats.py`) and the composite-token math both share with the compile stage (`composite_tokens.py`)."""

from __future__ import annotations

from ...lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"KVCompose": "method", "KVComposeStats": "stats"})
