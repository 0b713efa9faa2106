"""``prfaas kv-size``: KV bytes of one request from a model's exact geometry."""

from __future__ import annotations

import argparse
import json

from testbed import units
from testbed.errors import UserError
from testbed.models.spec import STATE_DTYPES, KVBytes, ModelSpec, list_presets, load_model_spec

KIND_LABELS = {"gqa": "full attention (GQA/MHA)", "mla": "full attention (MLA)", "linear": "linear (fixed state)", "swa": "sliding window"}


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "kv-size",
        help="KV bytes of a request by the model's geometry",
        description="KV-cache bytes of one request of N input tokens: the full-attention part (grows with N), "
        "the fixed linear-attention state, the sliding-window part, the total and a per-layer-kind breakdown. "
        f"Presets: {', '.join(list_presets())}.",
    )
    p.add_argument("--model", help="a preset name or a YAML spec file (see docs/models.md)")
    p.add_argument("--tokens", help="input tokens, e.g. 32768 or 32K (1K = 1024)")
    p.add_argument("--state-dtype", help=f"dtype of the recurrent state: {' or '.join(STATE_DTYPES[:2])} (default: the spec's, bfloat16)")
    p.add_argument("--json", action="store_true", help="print JSON (total_bytes, full_attention_bytes, ...)")
    p.set_defaults(func=run_kv_size)


def _tokens(text: str | None) -> int:
    if text is None:
        raise UserError("--tokens is required, e.g. --tokens 32K")
    try:
        return units.parse_tokens(text)
    except ValueError as exc:
        raise UserError(f"--tokens: {exc}") from None


def _state_dtype(text: str | None) -> str | None:
    if text is None:
        return None
    allowed = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
    if text.lower() not in allowed:
        raise UserError(f"--state-dtype: {text!r} is not allowed; use float32 or bfloat16")
    return allowed[text.lower()]


def kv_size_report(spec: ModelSpec, tokens: int, state_dtype: str | None) -> dict:
    b: KVBytes = spec.kv_bytes(tokens, state_dtype)
    counts = spec.count_by_kind()
    return {
        "model": spec.name,
        "tokens": tokens,
        "layers": len(spec.layers),
        "kv_dtype": spec.kv_dtype,
        "state_dtype": state_dtype or spec.state_dtype,
        "full_attention_bytes": b.full_attention_bytes,
        "full_attention_bytes_per_token": spec.full_attention_bytes_per_token,
        "fixed_state_bytes": b.fixed_state_bytes,
        "window_bytes": b.window_bytes,
        "total_bytes": b.total_bytes,
        "by_kind": {k: {"layers": counts[k], "bytes": v} for k, v in b.by_kind.items()},
    }


def run_kv_size(args: argparse.Namespace) -> int:
    if not args.model:
        raise UserError(f"--model is required: a preset ({', '.join(list_presets())}) or a YAML spec file")
    tokens = _tokens(args.tokens)
    state_dtype = _state_dtype(args.state_dtype)
    spec = load_model_spec(args.model)
    r = kv_size_report(spec, tokens, state_dtype)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0

    def row(label: str, n: int, note: str = "") -> str:
        return f"  {label:<16}{n:>18,} B  {units.format_bytes(n):>12}{note}"

    print(f"{spec.name}: {len(spec.layers)} layers, KV {r['kv_dtype']}, state {r['state_dtype']}, {tokens:,} tokens")
    print(row("full attention", r["full_attention_bytes"], f"  ({r['full_attention_bytes_per_token']:,} B/token)"))
    print(row("fixed state", r["fixed_state_bytes"]))
    if r["window_bytes"]:
        print(row("sliding window", r["window_bytes"], "  (min(tokens, window) positions)"))
    print(row("total", r["total_bytes"]))
    print("  by layer kind:")
    for kind, v in r["by_kind"].items():
        print(f"    {kind:<7}{v['layers']:>4} layers {v['bytes']:>18,} B  {KIND_LABELS[kind]}")
    return 0
