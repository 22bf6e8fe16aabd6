"""The runtime's math: pure functions on tensors (scores, selection, allocation, merges), no model."""
