"""KV benchmark: wire-format speed, the bandwidth-wall byte table, and prefill time per token on this CPU.

    python benchmarks/kv_bench.py [--quick] [--model kimi-linear-48b] [--json FILE]

Targets (exit status 1 if one is missed):
- serialise + deserialise >= 1 GB/s on one core for a 32K-token cache of a geometry-faithful preset
  (the serialised stream round-trips bit-identically);
- the byte table (KV bytes at 1K/8K/32K/128K for every preset, from `ModelSpec.kv_bytes`) equals the
  reference geometry (`tests/data/model-configs.json`) wherever the reference has the model (a missing
  reference file, or one that checks no preset, is a missed target);
- framing overhead <= 0.1% of the payload at >= 1K tokens for every preset.
Prefill time per token (faithful and tiny variants) is reported, not judged: it sizes scenario defaults.
`--quick` measures the wire at 8K tokens and prefill on fewer presets/tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from testbed.atomic import write_json  # noqa: E402
from testbed.kv.cache import KVCache, LayerKV  # noqa: E402
from testbed.kv.wire import decode_transfer, encode_cache, wire_bytes_for  # noqa: E402
from testbed.models.spec import list_presets, load_model_spec  # noqa: E402
from testbed.validation import output_file_option  # noqa: E402

TOKENS = {"1K": 1024, "8K": 8192, "32K": 32768, "128K": 131072}
REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "model-configs.json"
DENSE_REFERENCE = "minimax-m2.5"  # the paper's dense GQA comparison point
SERDES_TARGET_BPS = 1e9
OVERHEAD_TARGET = 0.001
console = Console(width=max(160, Console().width))


def spec_cache(spec, tokens: int, request_id: str = "bench") -> KVCache:
    """A cache with the spec's exact shapes, filled with random bits (the wire does not care about values)."""
    from testbed.models.layers import torch_dtype

    layers = []
    for i, layer in enumerate(spec.layers):
        tensors = {}
        for name, ts in spec.layer_tensors(i, tokens).items():
            t = torch.empty(ts.shape, dtype=torch_dtype(ts.dtype))
            t.view(torch.uint8).random_()
            tensors[name] = t
        layers.append(LayerKV(i, layer.kind, tensors))
    return KVCache(request_id, spec.name, tokens, layers)


def bench_serdes(model: str, tokens: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    spec = load_model_spec(model)
    cache = spec_cache(spec, tokens)
    payload = cache.nbytes
    stream = bytearray(wire_bytes_for(cache.request_id, [t.numel() * t.element_size() for lay in cache.layers for t in lay.tensors.values()], cache.model))
    best = {"encode_s": 1e9, "copy_s": 1e9, "decode_s": 1e9}
    decoded = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        bufs = encode_cache(cache)
        t1 = time.perf_counter()
        view, pos = memoryview(stream), 0
        for b in bufs:  # what the kernel's socket copy does; reported, not counted as serdes
            n = len(b) if isinstance(b, bytes) else b.nbytes
            view[pos:pos + n] = b
            pos += n
        t2 = time.perf_counter()
        decoded = decode_transfer(stream)
        t3 = time.perf_counter()
        for k, v in (("encode_s", t1 - t0), ("copy_s", t2 - t1), ("decode_s", t3 - t2)):
            best[k] = min(best[k], v)
        del decoded
    decoded = decode_transfer(stream)
    identical = all(torch.equal(a.tensors[n].view(torch.uint8), b.tensors[n].view(torch.uint8))
                    for a, b in zip(cache.layers, decoded.layers) for n in a.tensors)
    serdes_s = best["encode_s"] + best["decode_s"]
    return {"model": model, "tokens": tokens, "payload_bytes": payload, "wire_bytes": len(stream), **best,
            "serdes_bytes_per_s": payload / serdes_s, "bit_identical": identical,
            "overhead_fraction": (len(stream) - payload) / payload}


def byte_table() -> tuple[list[dict], list[str]]:
    rows, errors = [], []
    ref = {}
    if REFERENCE.exists():
        ref = {m["hf_repo"]: m for m in json.loads(REFERENCE.read_text())}
    else:
        errors.append(f"reference geometry {REFERENCE} not found: the byte table cannot be checked")
    dense32 = load_model_spec(DENSE_REFERENCE).kv_bytes(TOKENS["32K"]).total_bytes
    for name in list_presets():
        spec = load_model_spec(name)
        row: dict = {"model": name, "kinds": spec.count_by_kind()}
        for label, n in TOKENS.items():
            kb = spec.kv_bytes(n)
            sizes = [t.nbytes for i in range(len(spec.layers)) for t in spec.layer_tensors(i, n).values()]
            row[label] = kb.total_bytes
            row[f"overhead_{label}"] = (wire_bytes_for("req-0000000001", sizes, spec.name) - kb.total_bytes) / kb.total_bytes
            if row[f"overhead_{label}"] > OVERHEAD_TARGET:
                errors.append(f"{name} at {label}: framing overhead {row[f'overhead_{label}']:.4%} > 0.1%")
            r = ref.get(spec.hf_repo)
            if r is not None:
                row["reference_checked"] = True
                if r["total_bytes_bf16"][label] != kb.total_bytes:
                    errors.append(f"{name} at {label}: code says {kb.total_bytes}, reference {r['total_bytes_bf16'][label]}")
                fp32 = spec.kv_bytes(n, state_dtype="float32").total_bytes
                if r["total_bytes_conv_bf16_recurrent_fp32"][label] != fp32:
                    errors.append(f"{name} at {label} (fp32 state): code says {fp32}, reference "
                                  f"{r['total_bytes_conv_bf16_recurrent_fp32'][label]}")
        row["fixed_state_bytes"] = spec.kv_bytes(TOKENS["32K"]).fixed_state_bytes + spec.kv_bytes(TOKENS["32K"]).window_bytes
        row["dense_over_this_32K"] = dense32 / row["32K"]
        rows.append(row)
    if ref and not any(r.get("reference_checked") for r in rows):
        errors.append(f"no preset's hf_repo is in {REFERENCE.name}: the byte table was checked against nothing")
    return rows, errors


def bench_prefill(presets: list[str], variants: list[str], tokens: int) -> list[dict]:
    from testbed.models.torch_model import build_model, vocab_size

    torch.set_num_threads(1)
    out = []
    for name in presets:
        spec = load_model_spec(name)
        for variant in variants:
            model = build_model(spec, variant, seed=0, device="cpu")
            ids = torch.randint(0, vocab_size(spec, variant), (tokens,), generator=torch.Generator().manual_seed(0))
            model.prefill(ids[:8])  # warm-up
            t0 = time.perf_counter()
            _, cache = model.prefill(ids)
            dt = time.perf_counter() - t0
            out.append({"model": name, "variant": variant, "tokens": tokens, "prefill_s": dt,
                        "s_per_token": dt / tokens, "kv_bytes": cache.nbytes})
            console.print(f"  prefill {name:18s} {variant:8s} {dt / tokens * 1e3:8.2f} ms/token")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8K-token wire test, few presets for prefill")
    ap.add_argument("--model", default="kimi-linear-48b", help="preset for the serialise/deserialise test")
    ap.add_argument("--json", type=output_file_option, help="write all results to this file")
    args = ap.parse_args(argv)
    failures: list[str] = []

    rows, errors = byte_table()
    failures += errors
    t = Table(title="Bandwidth wall: KV bytes per request (bf16, from the specs)")
    for col in ["model", "layers", "1K", "8K", "32K", "128K", "fixed/window", "dense÷this @32K", "ref", "frame ovh @1K"]:
        t.add_column(col, justify="right" if col != "model" else "left")
    for r in rows:
        t.add_row(r["model"], " ".join(f"{n} {k}" for k, n in r["kinds"].items()),
                  *(f"{r[k]:,}" for k in TOKENS), f"{r['fixed_state_bytes']:,}", f"{r['dense_over_this_32K']:.1f}x",
                  "ok" if r.get("reference_checked") else "-", f"{r['overhead_1K']:.4%}")
    console.print(t)

    tokens = TOKENS["8K"] if args.quick else TOKENS["32K"]
    serdes = bench_serdes(args.model, tokens, repeats=2 if args.quick else 3)
    t = Table(title=f"Wire format, one core: {serdes['model']} at {tokens} tokens ({serdes['payload_bytes'] / 2**20:.1f} MiB)")
    for col in ["encode (hash, no copy)", "socket-like copy", "decode (copy+hash+verify)", "serialise+deserialise", "overhead", "bit-identical"]:
        t.add_column(col, justify="right")
    gbps = lambda s: f"{serdes['payload_bytes'] / s / 1e9:.2f} GB/s"  # noqa: E731
    t.add_row(gbps(serdes["encode_s"]), gbps(serdes["copy_s"]), gbps(serdes["decode_s"]),
              f"{serdes['serdes_bytes_per_s'] / 1e9:.2f} GB/s", f"{serdes['overhead_fraction']:.4%}", str(serdes["bit_identical"]))
    console.print(t)
    if serdes["serdes_bytes_per_s"] < SERDES_TARGET_BPS:
        failures.append(f"serialise+deserialise {serdes['serdes_bytes_per_s'] / 1e9:.2f} GB/s < 1 GB/s")
    if not serdes["bit_identical"]:
        failures.append("decoded cache differs from the original")

    presets = ["kimi-linear-48b", "minimax-m2.5"] if args.quick else list_presets()
    prefill = bench_prefill(presets, ["tiny", "faithful"], 64 if args.quick else 256)
    t = Table(title="Prefill time per token on this CPU (1 thread)")
    for col in ["model", "variant", "tokens", "ms/token", "KV bytes"]:
        t.add_column(col, justify="right" if col not in ("model", "variant") else "left")
    for p in prefill:
        t.add_row(p["model"], p["variant"], str(p["tokens"]), f"{p['s_per_token'] * 1e3:.2f}", f"{p['kv_bytes']:,}")
    console.print(t)

    if args.json:
        write_json(args.json, {"byte_table": rows, "serdes": serdes, "prefill": prefill,
                              "failures": failures}, indent=2)
    for f in failures:
        console.print(f"[red]MISSED[/red] {f}")
    if not failures:
        console.print("[green]all KV targets met[/green]")
    return 1 if failures else 0


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
