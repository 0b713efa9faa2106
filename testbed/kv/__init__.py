"""KV caches: cache objects, the checksummed wire format, the hybrid prefix cache pool, the multi-connection transport."""
