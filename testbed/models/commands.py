"""``prfaas kv-size``: KV bytes of one request from a model's exact geometry. ``prfaas profile``: a compute
profile measured on this host's device (testbed.models.profiling)."""

from __future__ import annotations

import argparse
import json

from testbed import units
from testbed.errors import UserError
from testbed.validation import at_least_one, comma_list, option, output_file_option, random_seed
from testbed.models.spec import STATE_DTYPES, KVBytes, ModelSpec, check_request_bytes, list_presets, load_model_spec, parse_state_dtype

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
    p.add_argument("--state-dtype", help=f"dtype of the recurrent state: {', '.join(STATE_DTYPES)} (default: the spec's, bfloat16)")
    p.add_argument("--json", action="store_true", help="print JSON (total_bytes, full_attention_bytes, ...)")
    p.set_defaults(func=run_kv_size)

    q = sub.add_parser(
        "profile",
        help="measure prefill and decode times on this host's device and write a compute profile",
        description="Times prefill against length and a decode step against batch and context for a runnable model "
        "(random weights) on this host, fits the profile curves, prints the fit error and writes a profile YAML "
        "that a scenario can name (serving.profiles.prfaas / pd) and `prfaas wall --measured` can read.",
    )
    q.add_argument("--model", help="a preset name or a YAML spec file")
    q.add_argument("--variant", default="faithful", help="faithful (real cache geometry), tiny, or full (real widths; default faithful)")
    q.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    q.add_argument("--out", type=output_file_option, help="profile YAML to write")
    q.add_argument("--lengths", help="prefill lengths, e.g. 256,512,1K (default: by device and variant)")
    q.add_argument("--batches", default="1,2,4,8", help="decode batch sizes (default 1,2,4,8)")
    q.add_argument("--contexts", help="decode context lengths (default: the shortest and longest prefill length)")
    q.add_argument("--repeats", type=option(at_least_one, whole=True), default=3, help="timed prefill runs per length after an untimed one, fastest kept (default 3)")
    q.add_argument("--depth", type=option(at_least_one, whole=True), help="build only the first N layers (reduced depth for small hosts)")
    q.add_argument("--layers", default="auto", help="full variant: all, sample (one timed block per layer kind, "
                   "extrapolated) or auto (all when it fits in half the free memory)")
    q.add_argument("--validate", action="store_true", help="full variant: also time the whole model at the shortest length "
                   "and print the extrapolation's error")
    q.add_argument("--clock", default="auto", help="wall, cpu (this process's CPU time; refused with --device cuda) or auto: wall on CUDA, cpu on the "
                   "CPU (robust on a shared host; with several torch threads it sums them)")
    q.add_argument("--seed", type=option(random_seed, whole=True), default=0, help="seed of the random weights and inputs timed (default 0)")
    q.set_defaults(func=run_profile)


def _tokens(text: str | None) -> int:
    if text is None:
        raise UserError("--tokens is required, e.g. --tokens 32K")
    try:
        return units.parse_tokens(text)
    except ValueError as exc:
        raise UserError(f"--tokens: {exc}") from None


def _state_dtype(text: str | None) -> str | None:
    """--state-dtype by `spec.parse_state_dtype`, the reader of a spec's and a scenario's state dtype (this option had
    its own table until 2026-12-07: float16 and fp8 refused, which a scenario or a spec file took)."""
    if text is None:
        return None
    try:
        return parse_state_dtype(text)
    except ValueError as exc:
        raise UserError(f"--state-dtype: {exc}") from None


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
    if state_dtype:  # the spec's own dtypes were checked when it was read
        check_request_bytes(spec, f"--state-dtype {state_dtype}", state_dtype=state_dtype)
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


def _token_list(text: str | None, option: str, least: int = 2, example: str = "256,512,1K") -> tuple[int, ...]:
    if text is None:  # left out: the plan's default
        return ()
    try:
        out = tuple(units.parse_tokens(x) for x in comma_list(text, option, example))
    except ValueError as exc:
        raise UserError(f"{option}: {exc}") from None
    if min(out) < least:
        raise UserError(f"{option}: give comma-separated whole numbers >= {least}, e.g. {example}")
    return out


def run_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from testbed.models.profiling import ProfilePlan, check_plan, measure, profile_document, write_profile
    from testbed.models.spec import VARIANTS

    if not args.model:
        raise UserError(f"--model is required: a preset ({', '.join(list_presets())}) or a YAML spec file")
    if not args.out:
        raise UserError("--out is required: the profile YAML to write, e.g. --out my-gpu.yaml")
    if args.variant not in VARIANTS:
        raise UserError(f"--variant: {args.variant!r} is not allowed; use one of: {', '.join(VARIANTS)}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device: {args.device!r} is not allowed; use one of: auto, cpu, cuda")
    if args.layers not in ("auto", "all", "sample"):
        raise UserError(f"--layers: {args.layers!r} is not allowed; use one of: auto, all, sample")
    if args.clock not in ("auto", "wall", "cpu"):
        raise UserError(f"--clock: {args.clock!r} is not allowed; use one of: auto, wall, cpu")

    # every input read before minutes of timing (--out by output_file_option, as argparse read it)
    batches = _token_list(args.batches, "--batches", least=1, example="1,2,4,8")
    spec = load_model_spec(args.model)  # refuses an unknown model before anything is built
    plan = ProfilePlan(spec.name if Path(args.model).suffix not in (".yaml", ".yml") else args.model, args.variant,
                       args.device, _token_list(args.lengths, "--lengths"), batches,
                       _token_list(args.contexts, "--contexts"), args.repeats, depth=args.depth, layers=args.layers,
                       validate=args.validate, seed=args.seed, clock=args.clock)
    check_plan(plan)  # the device, --depth and --clock too
    console = Console(stderr=True)
    with console.status(f"profiling {plan.model} ({plan.variant})") as status:
        m = measure(plan, progress=lambda msg: (console.log(msg), status.update(msg)))
    out = args.out
    prof = write_profile(profile_document(m, out.stem), out)
    meas = prof.extra["measured"]
    c = prof.coefficients + (0.0,) * (3 - len(prof.coefficients))
    print(f"{prof.model} ({plan.variant}, {meas['layers']}) on {prof.chip}, {meas['clock']} time")
    print(f"  prefill T(l) = {c[0]:.4g} + {c[1]:.4g} l + {c[2]:.4g} l^2 s; fit error: "
          f"rms {meas['prefill_fit_error']['rms_rel']:.1%}, max {meas['prefill_fit_error']['max_rel']:.1%} over {len(prof.points_tokens)} lengths")
    for n, s in zip(prof.points_tokens, prof.points_s):
        print(f"    {int(n):>7} tokens  {s:10.4f} s  (fit {prof.prefill_time_s(n):.4f} s)")
    d = prof.decode
    assert d is not None
    print(f"  decode step(b) = {d.step_s * 1e3:.3f} + {d.per_sequence_s * 1e3:.3f} b ms (b <= {d.max_batch}); fit error: "
          f"rms {meas['decode_fit_error']['rms_rel']:.1%}, max {meas['decode_fit_error']['max_rel']:.1%}")
    if meas.get("validation"):
        v = meas["validation"]
        print(f"  extrapolation check at {v['tokens']} tokens, {v['layers']} layers: whole model {v['whole_model_s']:.4f} s, "
              f"per-layer extrapolation {v['extrapolated_s']:.4f} s ({v['relative_error']:+.1%})")
    print(f"wrote {out}")
    return 0
