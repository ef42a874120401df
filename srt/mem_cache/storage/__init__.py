"""Storage backends of the hierarchical KV cache's third tier (`--hicache-storage-backend`)."""
