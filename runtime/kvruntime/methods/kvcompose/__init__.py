"""KVCompose at run time: the method (`method.py`), its compiled statistics (`stats.py`) and the composite-token
math both share with the compile stage (`composite_tokens.py`)."""

from .method import KVCompose
from .stats import KVComposeStats

__all__ = ["KVCompose", "KVComposeStats"]
