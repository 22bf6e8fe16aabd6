"""CompressKV's Semantic Retrieval Heads: the registration (`spec.py`, with the alias compresskv = srh+error-aware) and
the method (`method.py`)."""
