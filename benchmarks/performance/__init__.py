"""Performance study: prefill time and memory, the streamed prefill, refusal latency (README.md)."""
