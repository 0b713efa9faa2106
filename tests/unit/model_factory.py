"""Small hybrid model specs for the model tests: one geometry of each layer kind, a few wide."""

from __future__ import annotations

from testbed.models.spec import ModelSpec, parse_model_spec

LAYERS = {
    "delta": {"kind": "linear", "rule": "delta", "heads": 4, "qk_heads": 2, "key_dim": 8, "value_dim": 6, "conv_kernel": 4},
    "decay": {"kind": "linear", "rule": "decay", "heads": 2, "key_dim": 8, "value_dim": 8},
    "gqa": {"kind": "gqa", "kv_heads": 2, "k_head_dim": 12, "v_head_dim": 8},
    "mla": {"kind": "mla", "kv_lora_rank": 16, "rope_dim": 4},
    "swa": {"kind": "swa", "window": 6, "kv_heads": 2, "head_dim": 8},
}
HYBRID = ["delta", "gqa", "swa", "decay", "mla", "delta"]


def small_spec(kinds: list[str], kv_dtype: str = "bfloat16", state_dtype: str = "bfloat16") -> ModelSpec:
    return parse_model_spec({"name": "-".join(kinds), "kv_dtype": kv_dtype, "state_dtype": state_dtype,
                             "geometries": {k: LAYERS[k] for k in set(kinds)}, "layers": kinds})
