"""The evaluation suite run side by side with kvpress, and the summary of every study (RESULTS.md)."""
