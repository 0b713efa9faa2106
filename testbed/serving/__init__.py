"""Serving plane: prefill and decode workers, the router with its policies, the global KV cache manager."""
