"""Models: layer-by-layer specs with exact KV geometry, runnable torch hybrid models, compute profiles."""
