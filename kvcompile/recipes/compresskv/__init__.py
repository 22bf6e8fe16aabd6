"""CompressKV's compile stage: Semantic Retrieval Head scores from needle probes (`kvcompile heads`: `heads.py`,
the scores' math in `head_scores.py`, attention rows in `attention_capture.py`), then each layer's compression error
for the error-aware budgets (`kvcompile budgets`: `budgets.py`). Pictures in `plots.py`."""
