"""prfaas-testbed: emulate cross-datacenter prefill/decode LLM serving on real packets."""

__version__ = "0.1.0"
