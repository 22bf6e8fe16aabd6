"""Requests: what a compression may ask (`request`: ratios, budgets, memory modes, method options in their
declared types), what a method can serve (`serving`, from its artifacts' headers) and a request resolved once
(`resolved`). Torch-free: the command line refuses bad input with these before torch loads."""
