"""The runtime's default method and ratio for a model (`kvcompile tune`): the evaluation suite on validation
prompts, per method the largest ratio within a tolerance of the full cache (`tuning.py`). Picture in `plots.py`."""
