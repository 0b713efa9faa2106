"""benchmarks/compile_probe.py: the linear layers' state chain as one opaque operation (what lets a compiled
graph keep it out) computes exactly what the plain loop does, and its fake (shape-only) form agrees."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from testbed.models import layers
from testbed.models.spec import load_model_spec
from testbed.models.torch_model import build_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compile_probe.py"


@pytest.fixture(scope="module")
def probe() -> dict:
    """The script's globals (running it as a module registers its custom operation once)."""
    return runpy.run_path(str(SCRIPT), run_name="compile_probe")


def test_the_opaque_state_chain_is_the_plain_loop_bit_for_bit(probe, monkeypatch) -> None:
    model = build_model(load_model_spec("kimi-linear-48b"), "tiny", seed=1, device="cpu")  # bf16 state, delta rule
    ids = torch.randint(0, model.vocab_size, (45,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want, want_cache = model.prefill(ids[:37])
        want2, _ = model.prefill(ids[37:], want_cache)  # resumed mid-chunk: padding on both sides
        calls = []

        def spy(*args):
            calls.append(args)
            return probe["chain"](*args)

        monkeypatch.setattr(layers, "_state_chain", spy)
        got, got_cache = model.prefill(ids[:37])
        got2, _ = model.prefill(ids[37:], got_cache)
    assert len(calls) == 2 * 20  # once per linear layer and call: the op really served
    assert torch.equal(got, want) and torch.equal(got2, want2)
    for a, b in zip(got_cache.layers, want_cache.layers):
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    args = calls[0]
    z = args[4].new_empty(0)
    op_args = (args[0], args[4], z if args[5] is None else args[5], args[6], args[7], args[8], args[9], args[2], args[3],
               args[10], args[11], args[12], args[13] is not None)
    torch.library.opcheck(probe["chain_op"], op_args, test_utils=("test_schema", "test_faketensor"))
