"""prfaas-testbed: emulate cross-datacenter prefill/decode LLM serving on real packets."""

__version__ = "0.1.0"


def pythonpath() -> str:
    """PYTHONPATH for a child `python -m testbed...`: this checkout first (the code that started it), then ours."""
    import os
    from pathlib import Path

    return os.pathsep.join(p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")) if p)
