"""Evaluation of compressed generation: the suite run by `kvcompile eval` and the ratio search of `kvcompile tune`.

metrics: scores and summaries (pure); contestants: what is compared (kvcompile methods, kvpress presses, the full
cache); prefill: a contestant's prefill of a context, timed (model plumbing); runner: one prompt through one
contestant, answered and scored; store: resumable run records; report: tables
and plots; suite_run / tuning: the two commands' work."""
