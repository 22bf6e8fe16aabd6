"""KVCompose study: compiled and dynamic modes against kvpress's KVComposePress, answer coverage (README.md)."""
