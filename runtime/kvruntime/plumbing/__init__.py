"""Model plumbing: kvruntime's attention function, the cache's layers, hooks, recordings and second passes."""
