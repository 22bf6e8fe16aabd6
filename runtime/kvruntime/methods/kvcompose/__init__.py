"""KVCompose at run time: its registration (`spec.py`), the method (`method.py`) and its compiled statistics
(`stats.py`), which it shares with the compile stage; its composite-token math is `kvruntime.math.composite_tokens`
(distilled allocates with it too)."""

from __future__ import annotations

from ...lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"KVCompose": "method", "KVComposeStats": "stats"})
