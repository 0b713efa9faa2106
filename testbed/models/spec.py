"""Model specs: the one place that knows a model's cache geometry, layer by layer.

A spec is an ordered list of layers, each with its kind and the dimensions of what it caches:

- ``linear`` (KDA / Gated DeltaNet / Lightning): a fixed recurrent state ``[heads, key_dim, value_dim]``
  plus, with a short conv, a conv state ``[conv_kernel - 1, conv_channels]``. Same size at any length.
- ``gqa`` (full attention, GQA/MHA): K ``[tokens, kv_heads, k_head_dim]`` and V ``[tokens, kv_heads, v_head_dim]``.
- ``mla``: the latent ``[tokens, kv_lora_rank]`` and the RoPE key ``[tokens, rope_dim]``.
- ``swa``: like gqa, but only the last ``min(tokens, window)`` positions.

Byte counts (`ModelSpec.kv_bytes`), the runnable torch model (`torch_model`) and the KV wire format all
derive their tensor shapes from `LayerSpec.tensor_shapes`, so they cannot disagree. Specs are YAML files
(schema in docs/models.md); the presets live in ``presets/``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from testbed import units
from testbed.errors import FieldError, UserError
from testbed.kv.cache import FULL_KINDS
from testbed.validation import (Fields, at_most, count_up_to, name_or_stem, path_exists, path_is_dir, path_is_file, plain_name,
                                random_seed, read_yaml, shown, string, text, whole_number)

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
MODEL_NAMES = "the model: its KV transfers and profiles carry it"  # what a spec's name names (validation.plain_name)
MODEL_SPEC_WHAT = "a model spec (a YAML mapping of name, layers, ...: docs/models.md)"  # what read_yaml says a spec file should be

# Cache dtypes: canonical torch name -> bytes per element. Aliases are accepted in files and options.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8_e4m3fn"}
# A linear layer's recurrent state may be in any cache dtype: float8 state runs in the torch model as the others do
# (prefill, decode, batched decode, a checkpoint, the wire; the state is rounded to it at every chunk boundary).
# `parse_state_dtype` is the one reader of a state dtype: a spec file's state_dtype (the model's, a layer's), a
# scenario's model.state_dtype and `prfaas kv-size --state-dtype`. Before 2026-12-07 a spec file took fp8 and the
# other two refused it, and --state-dtype (its own table) refused the float16 that a scenario took.
STATE_DTYPES = tuple(DTYPE_BYTES)
DEFAULT_KV_DTYPE = "bfloat16"
DEFAULT_STATE_DTYPE = "bfloat16"
LINEAR_RULES = ("delta", "decay")


def _dtype(v: Any, what: str) -> str:
    """A cache dtype by its name or alias (every cache dtype is also a state dtype, `STATE_DTYPES`)."""
    name = DTYPE_ALIASES.get(str(v).lower(), str(v).lower())
    if name not in DTYPE_BYTES:
        names = ", ".join(list(DTYPE_BYTES) + [a for a, n in DTYPE_ALIASES.items() if n in DTYPE_BYTES])
        raise ValueError(f"{shown(v)} is not {what}; use one of: {names}")
    return name


def parse_dtype(v: Any) -> str:
    """``"bf16"`` -> ``"bfloat16"``; refuses anything that is not a cache dtype."""
    return _dtype(v, "a cache dtype")


def parse_state_dtype(v: Any) -> str:
    """``"fp32"`` -> ``"float32"``: the one reader of a linear layer's state dtype (`STATE_DTYPES`)."""
    return _dtype(v, "a state dtype")


# The largest size a geometry key may give (heads, dimensions, ranks, a window, a repeat): 2^24, past any model
# (a window of 16M tokens is `units.MAX_TOKENS`). `rope_dim: 1e400`-sized ints were accepted and a `repeat` of one
# was an OverflowError traceback before 2026-12-07. Read by `validation.count_up_to` (a size >= 1) and `at_most` over
# `whole_number` (conv_kernel, 0 for none); spec._whole repeated both until 2026-12-07.
MAX_SIZE = 2**24
_SIZE_WHY = "the largest size in a model spec (spec.MAX_SIZE, 2^24: past any model)"
_size = count_up_to(MAX_SIZE, _SIZE_WHY)
_size_or_none = at_most(whole_number, MAX_SIZE, why=_SIZE_WHY)
# The most KV bytes one request may cache at the longest request (`units.MAX_TOKENS`, 16M tokens): 2^62 B (4 EiB). The
# KV wire counts a request's bytes in 64 bits (the trailer's payload_bytes, a frame's offset and length: u64, docs/kv.md)
# and a run records kv_bytes and wire_bytes (the bytes plus their framing) in int64 columns (testbed.rundir), so a
# request must stay below 2^63 with room for its framing: 2^62 leaves it. A receiver's allocation bound
# (`WireLimits.max_request_bytes`, 64 GiB by default) is a run's setting, not the format's: every preset caches more at
# 16M tokens (llama-3.1-70b 5 TiB). Each size is at most 2^24, but their products were not bounded: a linear layer of
# heads = key_dim = value_dim = 2^24 (2^73 B of state) passed before 2026-12-07, and `prfaas check` gave a Lambda_max of
# 1e-14/s. Checked on a spec file (`check_request_bytes`), on a scenario's model.state_dtype and on --state-dtype.
MAX_REQUEST_KV_BYTES = 2**62


def _even(v: Any) -> int:
    n = _size(v)
    if n % 2:
        raise ValueError(f"{v!r} must be even (RoPE rotates pairs of dimensions)")
    return n


# ------------------------------------------------------------------------------------------ layers


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one cached tensor (names as in `testbed.kv.cache.TENSOR_NAMES`)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache geometry. Subclasses: `LinearLayer`, `GQALayer`, `MLALayer`, `SWALayer`."""

    kind: ClassVar[str] = ""

    def tensor_shapes(self, tokens: int, kv_dtype: str, state_dtype: str) -> dict[str, TensorSpec]:
        raise NotImplementedError


@dataclass(frozen=True)
class LinearLayer(LayerSpec):
    """Linear attention with a fixed state. ``rule``: ``delta`` (gated delta rule: KDA, GDN) or
    ``decay`` (gated linear attention with a fixed per-head decay: Lightning). The short conv runs over
    the concatenated q, k, v features, so ``conv_channels = 2 * qk_heads * key_dim + heads * value_dim``."""

    kind: ClassVar[str] = "linear"
    heads: int
    key_dim: int
    value_dim: int
    qk_heads: int
    conv_kernel: int = 0
    rule: str = "delta"
    state_dtype: str | None = None  # overrides the model's state dtype for this layer

    @property
    def conv_channels(self) -> int:
        return 2 * self.qk_heads * self.key_dim + self.heads * self.value_dim if self.conv_kernel else 0

    def tensor_shapes(self, tokens: int, kv_dtype: str, state_dtype: str) -> dict[str, TensorSpec]:
        out = {"state": TensorSpec((self.heads, self.key_dim, self.value_dim), state_dtype)}
        if self.conv_kernel:
            out["conv"] = TensorSpec((self.conv_kernel - 1, self.conv_channels), kv_dtype)
        return out


@dataclass(frozen=True)
class GQALayer(LayerSpec):
    kind: ClassVar[str] = "gqa"
    kv_heads: int
    k_head_dim: int
    v_head_dim: int

    def kept_tokens(self, tokens: int) -> int:
        return tokens

    def tensor_shapes(self, tokens: int, kv_dtype: str, state_dtype: str) -> dict[str, TensorSpec]:
        n = self.kept_tokens(tokens)
        return {
            "k": TensorSpec((n, self.kv_heads, self.k_head_dim), kv_dtype),
            "v": TensorSpec((n, self.kv_heads, self.v_head_dim), kv_dtype),
        }


@dataclass(frozen=True)
class SWALayer(GQALayer):
    """Sliding-window attention: keeps the last ``window`` positions (the query's own included).
    A subclass of `GQALayer` (same tensors); tell them apart by ``kind``."""

    kind: ClassVar[str] = "swa"
    window: int = 1

    def kept_tokens(self, tokens: int) -> int:
        return min(tokens, self.window)


@dataclass(frozen=True)
class MLALayer(LayerSpec):
    kind: ClassVar[str] = "mla"
    kv_lora_rank: int
    rope_dim: int

    def tensor_shapes(self, tokens: int, kv_dtype: str, state_dtype: str) -> dict[str, TensorSpec]:
        return {
            "latent": TensorSpec((tokens, self.kv_lora_rank), kv_dtype),
            "k_rope": TensorSpec((tokens, self.rope_dim), kv_dtype),
        }


LAYER_CLASSES: dict[str, type[LayerSpec]] = {c.kind: c for c in (LinearLayer, GQALayer, MLALayer, SWALayer)}


# ------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class KVBytes:
    """KV bytes of one request. ``full_attention_bytes`` grows with the tokens (gqa, mla);
    ``fixed_state_bytes`` is the linear layers' recurrent + conv state; ``window_bytes`` is the SWA
    part (min(tokens, window) positions); ``total_bytes`` is their sum."""

    full_attention_bytes: int
    fixed_state_bytes: int
    total_bytes: int
    by_kind: dict[str, int]
    window_bytes: int = 0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: tuple[LayerSpec, ...]
    kv_dtype: str = DEFAULT_KV_DTYPE
    state_dtype: str = DEFAULT_STATE_DTYPE
    description: str = ""
    hf_repo: str = ""
    source: str = ""  # the file it was read from

    def layer_state_dtype(self, layer_index: int, state_dtype: str | None = None) -> str:
        """An explicit `state_dtype` (the CLI's ``--state-dtype``) wins over the layer's and the model's."""
        layer = self.layers[layer_index]
        if state_dtype:
            return parse_state_dtype(state_dtype)
        return getattr(layer, "state_dtype", None) or self.state_dtype

    def layer_tensors(self, layer_index: int, tokens: int, state_dtype: str | None = None,
                      full_attention_dtype: str | None = None) -> dict[str, TensorSpec]:
        """Shapes and dtypes of what layer `layer_index` caches after `tokens` positions; `full_attention_dtype`:
        a gqa or mla layer's tensors in that dtype instead of `kv_dtype` (float8 on the wire: `policy.kv_compression`)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        layer = self.layers[layer_index]
        kv_dtype = full_attention_dtype if full_attention_dtype and layer.kind in FULL_KINDS else self.kv_dtype
        return layer.tensor_shapes(tokens, kv_dtype, self.layer_state_dtype(layer_index, state_dtype))

    def layer_bytes(self, layer_index: int, tokens: int, state_dtype: str | None = None,
                    full_attention_dtype: str | None = None) -> int:
        return sum(t.nbytes for t in self.layer_tensors(layer_index, tokens, state_dtype, full_attention_dtype).values())

    def kv_bytes(self, tokens: int, state_dtype: str | None = None, full_attention_dtype: str | None = None) -> KVBytes:
        by_kind: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            by_kind[layer.kind] = by_kind.get(layer.kind, 0) + self.layer_bytes(i, tokens, state_dtype, full_attention_dtype)
        full = by_kind.get("gqa", 0) + by_kind.get("mla", 0)
        fixed = by_kind.get("linear", 0)
        window = by_kind.get("swa", 0)
        return KVBytes(full, fixed, full + fixed + window, by_kind, window)

    @property
    def full_attention_bytes_per_token(self) -> int:
        return self.kv_bytes(1).full_attention_bytes

    def count_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + 1
        return out


def check_request_bytes(spec: ModelSpec, field: str, source: str | None = None, *, state_dtype: str | None = None,
                        given: str = "") -> None:
    """Refuses, as a `FieldError` at `field` (of `source`), a spec whose request of `units.MAX_TOKENS` tokens (its state
    in `state_dtype` when given: it wins over the layers' own, as --state-dtype does) caches more than
    `MAX_REQUEST_KV_BYTES`, naming the bytes and the largest layer; `given`, when set, names what was given first
    ("float32 state: a request of ..."). The one message of the three readers: a spec file's `layers`, a scenario's
    `model.state_dtype` and `kv-size --state-dtype`."""
    tokens = units.MAX_TOKENS
    b = spec.kv_bytes(tokens, state_dtype)
    if b.total_bytes <= MAX_REQUEST_KV_BYTES:
        return
    sizes = [spec.layer_bytes(i, tokens, state_dtype) for i in range(len(spec.layers))]
    big = max(range(len(sizes)), key=sizes.__getitem__)
    raise FieldError(field, f"{given + ': ' if given else ''}a request of {tokens:,} tokens (units.MAX_TOKENS, the longest) "
                     f"caches {b.total_bytes:.3g} bytes (full attention {b.full_attention_bytes:.3g}, fixed state "
                     f"{b.fixed_state_bytes:.3g}, window {b.window_bytes:.3g}), more than 2^62 = {MAX_REQUEST_KV_BYTES:.3g} "
                     f"(spec.MAX_REQUEST_KV_BYTES: the KV wire's and a run's 64-bit byte counts); the largest layer, {big} "
                     f"({spec.layers[big].kind}), caches {sizes[big]:.3g}", source)


# ------------------------------------------------------------------------------------- YAML schema

_SPEC_KEYS = ("name", "description", "hf_repo", "kv_dtype", "state_dtype", "geometries", "layers")


def _parse_layer(f: Fields) -> LayerSpec:
    kind = f.choice("kind", tuple(LAYER_CLASSES))
    layer: LayerSpec
    if kind == "linear":
        heads = f.get("heads", _size)
        key_dim = f.get("key_dim", _size)
        qk_heads = f.get("qk_heads", _size, heads)
        layer = LinearLayer(
            heads=heads,
            key_dim=key_dim,
            value_dim=f.get("value_dim", _size, key_dim),
            qk_heads=qk_heads,
            conv_kernel=f.get("conv_kernel", _size_or_none, 0),
            rule=f.choice("rule", LINEAR_RULES, "delta"),
            state_dtype=f.get("state_dtype", parse_state_dtype, None),
        )
        if heads % qk_heads:
            raise f.error("qk_heads", f"{qk_heads} must divide heads ({heads}): each q/k head serves heads/qk_heads value heads")
        if layer.conv_kernel == 1:
            raise f.error("conv_kernel", "1 keeps no conv state; use 0 for no short conv or >= 2")
        if layer.conv_channels > MAX_SIZE:  # a cached tensor's dimension, as every size (a shape is u32 on the wire)
            raise f.error("conv_channels", f"the conv state's width 2 x qk_heads x key_dim + heads x value_dim is {layer.conv_channels}, "
                                           f"more than {MAX_SIZE}, {_SIZE_WHY}")
        if f.has("conv_channels"):
            channels = f.get("conv_channels", _size)
            if channels != layer.conv_channels:
                raise f.error(
                    "conv_channels",
                    f"{channels} does not match the conv over q, k, v: 2 x qk_heads x key_dim + heads x value_dim = "
                    f"{layer.conv_channels}" + ("" if layer.conv_kernel else " (no conv_kernel given, so 0)"),
                )
    elif kind in ("gqa", "swa"):
        kv_heads = f.get("kv_heads", _size)
        if f.has("head_dim") and (f.has("k_head_dim") or f.has("v_head_dim")):
            raise f.error("head_dim", "give either head_dim or k_head_dim and v_head_dim, not both")
        if f.has("head_dim"):
            k_dim = f.get("head_dim", _even)
            v_dim = k_dim
        else:
            k_dim = f.get("k_head_dim", _even)
            v_dim = f.get("v_head_dim", _size)
        if kind == "gqa":
            layer = GQALayer(kv_heads, k_dim, v_dim)
        else:
            layer = SWALayer(kv_heads, k_dim, v_dim, window=f.get("window", _size))
    else:
        layer = MLALayer(kv_lora_rank=f.get("kv_lora_rank", _size), rope_dim=f.get("rope_dim", _even))
    f.done()
    return layer


def _expand_layers(f: Fields, geometries: dict[str, LayerSpec]) -> tuple[LayerSpec, ...]:
    """``layers:`` items: a geometry name, an inline geometry (has ``kind``), or ``{repeat: N, pattern: [names]}``."""
    raw = f.data.get("layers")
    f.mark_read("layers")
    if not isinstance(raw, list) or not raw:
        raise f.error("layers", "must be a non-empty list of layers in model order (names from geometries, inline layers, or {repeat, pattern})")
    known = ", ".join(geometries) or "(no geometries defined)"

    def named(v: Any, where: str) -> LayerSpec:
        if not isinstance(v, str) or v not in geometries:
            raise FieldError(where, f"{v!r} is not a geometry name; defined: {known}", f.source)
        return geometries[v]

    out: list[LayerSpec] = []
    for i, item in enumerate(raw):
        where = f"{f.name('layers')}[{i}]"
        if isinstance(item, dict) and "kind" in item:
            out.append(_parse_layer(Fields(item, where, f.source)))
        elif isinstance(item, dict):
            g = Fields(item, where, f.source)
            repeat = g.get("repeat", _size, 1)
            pattern = g.get("pattern", lambda v: v if isinstance(v, list) and v else _raise("must be a non-empty list of geometry names"))
            g.done()
            block = [named(v, f"{where}.pattern[{j}]") for j, v in enumerate(pattern)]
            if len(out) + len(block) * repeat > 4096:  # before the list is made
                raise f.error("layers", f"{where}: {repeat} x {len(block)} layers makes more than 4096; at most 4096")
            out.extend(block * repeat)
        else:
            out.append(named(item, where))
    if len(out) > 4096:
        raise f.error("layers", f"{len(out)} layers; at most 4096")
    return tuple(out)


def _raise(message: str) -> Any:
    raise ValueError(message)


def parse_model_spec(data: Any, source: str | None = None, default_name: str = "") -> ModelSpec:
    """A spec from parsed YAML; every error names the field (``geometries.kda.heads``, ``layers[2]``)."""
    f = Fields(data, "", source)
    # a plain name (validation.plain_name: no '/', at most 200 bytes), given or the file's: the KV trailer carries it in
    # at most 255 bytes and a measured profile names its model by it; '../x' and 300 characters passed prfaas check
    # before 2026-12-07, and a run's first transfer failed
    name = name_or_stem(f, MODEL_NAMES, default_name) if default_name else f.get("name", lambda v: plain_name(v, MODEL_NAMES))
    geometries: dict[str, LayerSpec] = {}
    g = f.section("geometries")
    for key in g.data:
        geometries[str(key)] = _parse_layer(g.section(str(key)))
    spec = ModelSpec(
        name=name,
        layers=_expand_layers(f, geometries),
        kv_dtype=f.get("kv_dtype", parse_dtype, DEFAULT_KV_DTYPE),
        state_dtype=f.get("state_dtype", parse_state_dtype, DEFAULT_STATE_DTYPE),
        description=f.get("description", string, ""),
        hf_repo=f.get("hf_repo", string, ""),
        source=source or "",
    )
    f.done()
    check_request_bytes(spec, f.name("layers"), f.source)
    return spec


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _load_preset(path: str) -> ModelSpec:
    """Presets are read once per process (specs are immutable)."""
    return parse_model_spec(read_yaml(Path(path), MODEL_SPEC_WHAT), path)


def load_model_spec(name_or_file: str, base_dir: str | Path | None = None) -> ModelSpec:
    """A preset name (``kimi-linear-48b``) or a YAML spec file; a relative file is also looked up under `base_dir`."""
    text = str(name_or_file).strip()
    if not text:
        raise UserError(f"model name is empty; presets: {', '.join(list_presets())}")
    preset = PRESETS_DIR / f"{text.lower()}.yaml"
    if "/" not in text and not text.endswith((".yaml", ".yml")) and path_exists(preset):
        return _load_preset(str(preset))
    candidates = [Path(text)]
    if base_dir is not None and not Path(text).is_absolute():
        candidates.append(Path(base_dir) / text)
    for path in candidates:
        if path_is_file(path):
            return parse_model_spec(read_yaml(path, MODEL_SPEC_WHAT), str(path), default_name=path.stem)
    folder = next((path for path in candidates if path_is_dir(path)), None)
    # the name as `validation.shown` shows it: a 5000-character name was echoed whole before 2026-12-07
    if folder is not None:  # "no such file" before 2026-12-07
        raise UserError(f"model {shown(text)}: {folder} is a folder; name a preset or a YAML spec file (docs/models.md)")
    raise UserError(f"model {shown(text)}: not a preset and no such file; presets: {', '.join(list_presets())}")


# -------------------------------------------------------------------------------- scenario section

COMPUTE_MODES = ("torch", "profile")
VARIANTS = ("faithful", "tiny", "full")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelSection:
    """The scenario's ``model:`` section. `spec` is the geometry of the named model (what `profile`
    mode charges on the wire); in `torch` mode `build_model(spec, variant, seed, device)` runs it."""

    name: str
    spec: ModelSpec
    compute: str = "torch"
    variant: str = "tiny"
    state_dtype: str = DEFAULT_STATE_DTYPE
    device: str = "auto"
    seed: int | None = None  # None: the scenario's seed
    profile: str | None = None  # compute-profile name for `profile` mode (see testbed.models.profiles)


def parse_model_section(f: Fields) -> ModelSection:
    name = f.get("name", text)
    base = Path(f.source).parent if f.source else None
    try:
        spec = load_model_spec(name, base)
    except UserError as exc:
        raise f.error("name", str(exc)) from None
    state_dtype = f.get("state_dtype", parse_state_dtype, None)
    if state_dtype:
        spec = replace(spec, state_dtype=state_dtype)
        check_request_bytes(spec, f.name("state_dtype"), f.source, given=f"{state_dtype} state")
    section = ModelSection(
        name=name,
        spec=spec,
        compute=f.choice("compute", COMPUTE_MODES, "torch"),
        variant=f.choice("variant", VARIANTS, "tiny"),
        state_dtype=spec.state_dtype,
        device=f.choice("device", DEVICES, "auto"),
        seed=f.get("seed", random_seed, None),
        profile=f.get("profile", text, None),
    )
    f.done()
    return section

