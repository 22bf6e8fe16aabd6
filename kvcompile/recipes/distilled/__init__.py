"""The distilled scorer's compile stage (`kvcompile distill`): the second pass's scores on calibration prompts
and the ridge fit of a one-pass student (`distill.py`). Picture in `plots.py`."""
