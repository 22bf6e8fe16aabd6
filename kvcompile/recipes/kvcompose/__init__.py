"""KVCompose's compile stage (`kvcompile stats`): attention statistics over calibration prompts, the layer
allocation for each compiled ratio (`attention_stats.py`). Picture in `plots.py`."""
