"""Benchmark studies: one package per study; run a script from the repository root with
`python -m benchmarks.<study>.<script>` (see benchmarks/README.md)."""
