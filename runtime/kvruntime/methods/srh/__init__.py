"""CompressKV's Semantic Retrieval Heads: the registration (`spec.py`, with the alias compresskv = srh+budgets) and
the method (`method.py`)."""
