"""CompressKV study: retrieval accuracy of the compiled SRH heads and layer budgets (README.md)."""
