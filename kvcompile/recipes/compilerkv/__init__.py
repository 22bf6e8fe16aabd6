"""CompilerKV's compile stage (`kvcompile tables`): bandit experience from rollouts on calibration prompts
(`experience_collection.py`, records in `bandit_experience.py`, continuation NLL in `continuation_nll.py`), then the
head-reliability and risk-threshold tables learned from it with offline CQL (`offline_cql.py`, rounds in
`tables.py`). Picture in `plots.py`."""
