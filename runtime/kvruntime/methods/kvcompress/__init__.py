"""KV-Compress: its registration (`spec.py`) and the method (`method.py`)."""
