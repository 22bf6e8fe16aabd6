"""CompressKV's compile stage: Semantic Retrieval Head scores from needle probes (`kvcompile heads`: `heads.py`,
the scores' math in `head_scores.py`, attention rows in `attention_capture.py`), then each layer's compression error
for the error-aware budgets (`kvcompile layer-errors`: `layer_errors.py`). Pictures in `plots.py`."""
