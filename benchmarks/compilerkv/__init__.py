"""CompilerKV study: the learned tables ablated, their stability, the reward noise, answer coverage (README.md)."""
