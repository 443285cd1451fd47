"""LMCache's own engine on a CPU paged KV cache (connector) and the harness that drives it."""
