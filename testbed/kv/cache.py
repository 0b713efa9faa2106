"""KV cache objects: what a prefill produces, what crosses the WAN, what a decode continues from.

A cache is a list of per-layer entries in model order. Each entry names its layer kind and holds
named tensors in a fixed order per kind:

- ``linear`` (KDA / GDN / Lightning): ``state`` [heads, d_k, d_v] and, if the layer has a short conv,
  ``conv`` [kernel - 1, channels]. Fixed size whatever the length.
- ``gqa`` (full attention, GQA/MHA): ``k`` [tokens, kv_heads, d_k], ``v`` [tokens, kv_heads, d_v].
- ``mla``: ``latent`` [tokens, kv_lora_rank], ``k_rope`` [tokens, rope_dim].
- ``swa``: ``k``/``v`` like gqa but only the last min(tokens, window) positions.

The wire format (`testbed.kv.wire`) sends these tensors as they are; the model (`testbed.models`)
produces and consumes them. The batch dimension is absent: one cache per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensors are torch tensors; importing torch here would slow every command that touches KV metadata
    import torch

LAYER_KINDS = ("linear", "gqa", "mla", "swa")
FULL_KINDS = ("gqa", "mla")  # full attention: cache every position, what grows with the prompt
TENSOR_NAMES = {
    "linear": ("state", "conv"),
    "gqa": ("k", "v"),
    "mla": ("latent", "k_rope"),
    "swa": ("k", "v"),
}


@dataclass
class LayerKV:
    layer_index: int
    kind: str
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class KVCache:
    """The cache of one request after `tokens` positions (the prefix it covers)."""

    request_id: str
    model: str
    tokens: int
    layers: list[LayerKV] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + layer.nbytes
        return out
