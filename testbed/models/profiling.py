"""``prfaas profile``: measure this host's prefill time against length and decode step time against batch
and context for one model, and write a compute profile in the format of ``profiles/*.yaml`` (issue 12
item 5), so profile-mode runs and the throughput model can use the user's own device.

Prefill: the fastest of `repeats` runs after one untimed run, per length. Decode: a step of batch b is what
the decode worker does per step, one batched ``decode_batch`` pass (`decode_step_time_s`), on caches of
the model's exact geometry with random values at each context length; the median of `steps` steps after
one untimed step.
The ``full`` variant (testbed.models.full) is timed whole when it fits in half the device's free memory,
else per layer kind and extrapolated; ``--validate`` compares the two at the given depth.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from testbed.atomic import make_dirs, write_text
from testbed.errors import UserError
from testbed.models.profiles import ComputeProfile, fit_prefill


@dataclass(frozen=True)
class ProfilePlan:
    model: str
    variant: str = "faithful"
    device: str = "auto"
    lengths: tuple[int, ...] = ()  # empty: defaults for the device and variant
    batches: tuple[int, ...] = (1, 2, 4, 8)
    contexts: tuple[int, ...] = ()  # empty: the shortest and longest prefill length
    repeats: int = 1
    decode_steps: int = 3
    depth: int | None = None  # build only the first `depth` layers (reduced-depth runs on small hosts)
    layers: str = "auto"  # full variant: "all" (time the whole model), "sample" (one block per kind), "auto"
    validate: bool = False  # full variant: also time the whole (reduced-depth) model and compare
    seed: int = 0
    clock: str = "auto"  # "wall", "cpu" (this process's CPU time), "auto": wall on CUDA, cpu on the CPU


@dataclass
class Measurement:
    plan: ProfilePlan
    device: str
    chip: str
    prefill: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)
    decode: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, context, seconds per step)
    kv_bytes: list[tuple[int, int]] = field(default_factory=list)  # (tokens, bytes of the cache that model makes)
    layers: str = "all"
    validation: dict[str, Any] | None = None
    per_layer: list[dict[str, Any]] = field(default_factory=list)
    clock: str = "wall"


def default_lengths(device_type: str, variant: str) -> tuple[int, ...]:
    if device_type == "cuda":
        return (1024, 2048, 4096, 8192, 16384, 32768)
    return {"tiny": (256, 512, 1024, 2048), "faithful": (128, 256, 512, 1024)}.get(variant, (64, 128, 256))


def clock_for(plan: ProfilePlan, device_type: str) -> tuple[str, Callable[[], float]]:
    """Wall time on a GPU (what a user's engine sees). On the CPU this process's CPU time by default: the
    compute itself, and what a shared host leaves of it (with several torch threads it sums them)."""
    kind = plan.clock if plan.clock != "auto" else ("wall" if device_type == "cuda" else "cpu")
    if kind == "cpu" and device_type == "cuda":  # the host's CPU time of launching kernels is not the GPU's time
        raise UserError("--clock: cpu times this process on the host, not the GPU's work; on a CUDA device use wall or auto")
    return kind, (time.process_time if kind == "cpu" else time.perf_counter)


def _sync(device: Any) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if getattr(device, "type", device) == "cuda" else (lambda: None)


def chip_name(device: Any) -> str:
    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def model_spec(plan: ProfilePlan) -> Any:
    """The geometry the measured model caches (tiny shrinks it; depth keeps the first layers)."""
    from testbed.models.spec import load_model_spec
    from testbed.models.torch_model import tiny_spec

    spec = load_model_spec(plan.model)
    if plan.depth is not None:
        if not 1 <= plan.depth <= len(spec.layers):
            raise UserError(f"--depth: {plan.depth} is not within 1..{len(spec.layers)} (layers of {spec.name})")
        spec = replace(spec, layers=spec.layers[:plan.depth])
    return tiny_spec(spec) if plan.variant == "tiny" else spec


def _whole_fits(spec: Any, device: Any) -> bool:
    """Whether a full-width model of `spec` fits in half of the device's free memory (fp32 weights)."""
    import torch

    from testbed.models.full import build_full_model, layer_kinds, load_widths

    per_kind = {}
    for kind, idx in layer_kinds(spec, load_widths(spec.name)).items():
        m = build_full_model(spec, device="cpu", layers=[idx[0]])
        per_kind[kind] = (sum(p.numel() for p in m.blocks.parameters()), len(idx))
        head = sum(p.numel() for p in m.parameters()) - per_kind[kind][0]
        del m
    need = 4 * (head + sum(n * k for n, k in per_kind.values()))
    if getattr(device, "type", device) == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return need < free / 2


def decode_step_time_s(model: Any, caches: list[Any], first_token: int, steps: int, sync: Callable[[], None],
                       clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of one decode step for the batch `caches`: one `decode_batch` pass, as the decode
    worker's continuous batching does. One untimed step first: a batch's first step on a device pays for
    its kernels' first launch (and with `steps` 1 it would be the figure)."""
    model.decode_batch([first_token] * len(caches), caches, check=False)
    times = []
    for _ in range(max(1, steps)):
        sync()
        t0 = clock()
        model.decode_batch([first_token] * len(caches), caches, check=False)
        sync()
        times.append(clock() - t0)
    return statistics.median(times)


def check_plan(plan: ProfilePlan) -> tuple[Any, Any, tuple[str, Callable[[], float]]]:
    """(the device, the model's geometry, the clock) of `plan`, or the `UserError` that refuses it (no such device,
    a --depth past the model's layers, --clock cpu on CUDA): asked before anything is built or written."""
    from testbed.models.torch_model import resolve_device

    dev = resolve_device(plan.device)
    return dev, model_spec(plan), clock_for(plan, dev.type)


def measure(plan: ProfilePlan, progress: Callable[[str], None] | None = None) -> Measurement:
    import torch

    from testbed.models.torch_model import build_model, synthetic_cache

    dev, spec, (clock_name, clock) = check_plan(plan)
    lengths = plan.lengths or default_lengths(dev.type, plan.variant)
    contexts = plan.contexts or (min(lengths), max(lengths))
    out = Measurement(plan, dev.type, chip_name(dev), kv_bytes=[(n, spec.kv_bytes(n).total_bytes) for n in lengths])
    out.clock = clock_name
    note = progress or (lambda _msg: None)
    sample = plan.variant == "full" and (plan.layers == "sample" or (plan.layers == "auto" and not _whole_fits(spec, dev)))
    if sample:
        from testbed.models.full import time_decode_per_layer, time_prefill_per_layer

        out.layers = f"{len(spec.layers)} layers, extrapolated from one timed block per layer kind"
        for n in lengths:
            s, per = time_prefill_per_layer(spec, n, plan.seed, str(dev.type), plan.repeats, clock)
            out.prefill.append((n, s))
            out.per_layer += [{"phase": "prefill", "tokens": n, "kind": t.kind, "layers": t.layers, "seconds": t.seconds} for t in per]
            note(f"prefill {n} tokens: {s:.3f} s (extrapolated)")
        for c in contexts:
            s, per = time_decode_per_layer(spec, c, plan.seed, str(dev.type), max(plan.repeats, plan.decode_steps), clock)
            out.decode += [(b, c, b * s) for b in plan.batches]
            note(f"decode step at context {c}: {s * 1e3:.1f} ms per request (extrapolated)")
        if plan.validate:
            out.validation = validate_extrapolation(spec, min(lengths), plan.seed, str(dev.type), plan.repeats, out.prefill[0][1], clock)
        return out
    model = build_model(model_spec(replace(plan, variant="faithful")), plan.variant, plan.seed, str(dev.type))  # tiny shrinks it itself
    model.last_logits_only = True
    out.layers = f"{len(spec.layers)} layers" + (f" (the first {plan.depth} of the model)" if plan.depth else "")
    sync = _sync(dev)
    gen = torch.Generator().manual_seed(plan.seed)
    vocab = model.vocab_size
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, vocab, (n,), generator=gen)
            model.prefill(ids)  # warm-up at this shape (allocator, kernel selection)
            best = float("inf")
            for _ in range(max(1, plan.repeats)):
                sync()
                t0 = clock()
                model.prefill(ids)
                sync()
                best = min(best, clock() - t0)
            out.prefill.append((n, best))
            note(f"prefill {n} tokens: {best:.3f} s")
        for c in contexts:
            caches = [synthetic_cache(model.spec, c, seed=plan.seed + i, device=str(dev.type)) for i in range(max(plan.batches))]
            for b in plan.batches:
                s = decode_step_time_s(model, [_copy(x) for x in caches[:b]], 1, plan.decode_steps, sync, clock)
                out.decode.append((b, c, s))
                note(f"decode batch {b} at context {c}: {s * 1e3:.1f} ms per step")
    if plan.validate and plan.variant == "full":
        from testbed.models.full import time_prefill_per_layer

        est, _ = time_prefill_per_layer(spec, min(lengths), plan.seed, str(dev.type), plan.repeats, clock)
        out.validation = _validation(min(lengths), out.prefill[0][1], est, len(spec.layers))
    return out


def _copy(cache: Any) -> Any:
    from testbed.kv.cache import KVCache

    return KVCache(cache.request_id, cache.model, cache.tokens, list(cache.layers))


def _validation(tokens: int, whole_s: float, extrapolated_s: float, layers: int) -> dict[str, Any]:
    return {"tokens": tokens, "layers": layers, "whole_model_s": round(whole_s, 6), "extrapolated_s": round(extrapolated_s, 6),
            "relative_error": round(extrapolated_s / whole_s - 1.0, 4)}


def validate_extrapolation(spec: Any, tokens: int, seed: int, device: str, repeats: int, extrapolated_s: float,
                           clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Time the whole model of `spec` (it must fit) at `tokens` and compare with the per-layer extrapolation."""
    import torch

    from testbed.models.full import _time, build_full_model

    m = build_full_model(spec, seed, device)
    ids = torch.randint(0, m.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    whole = _time(lambda: m.prefill(ids), repeats, m.device, clock)
    return _validation(tokens, whole, extrapolated_s, len(spec.layers))


# ------------------------------------------------------------------------------------------- fitting


def fit_errors(tokens: Sequence[float], seconds: Sequence[float], coefficients: Sequence[float]) -> dict[str, float]:
    """Relative residuals of a fitted curve at its points: root mean square and the largest magnitude."""
    t = np.asarray(seconds, dtype=float)
    fitted = np.polyval(list(coefficients)[::-1], np.asarray(tokens, dtype=float))
    rel = (fitted - t) / t
    return {"rms_rel": float(np.sqrt(np.mean(rel**2))), "max_rel": float(np.max(np.abs(rel)))}


def fit_prefill_robust(points: Sequence[tuple[int, float]]) -> tuple[tuple[float, ...], int]:
    """The quadratic fit, else a line, else a constant: a noisy host or a few short lengths can bend a
    quadratic below zero or make it concave (attention never makes prefill time concave, and a concave
    curve turns negative when extrapolated)."""
    l = [p[0] for p in points]
    s = [p[1] for p in points]
    last: UserError | None = None
    for degree in (min(2, len(points) - 1), 1, 0):
        if degree < 0 or degree > len(points) - 1:
            continue
        try:
            coeffs = fit_prefill(l, s, degree)
        except UserError as exc:
            last = exc
            continue
        if degree == 2 and coeffs[2] < 0:
            last = UserError("the quadratic fit is concave")
            continue
        return coeffs, degree
    raise UserError(f"prefill points {points}: no usable fit ({last})")


def fit_decode(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, int, dict[str, float]]:
    """step_s + per_sequence_s x batch at the median context (the profile format has no context term; the
    points keep it). Returns (step_s, per_sequence_s, that context, fit error)."""
    contexts = sorted({c for _, c, _ in points})
    ctx = contexts[len(contexts) // 2]
    b = np.array([p[0] for p in points if p[1] == ctx], dtype=float)
    s = np.array([p[2] for p in points if p[1] == ctx], dtype=float)
    if b.size >= 2 and np.ptp(b) > 0:
        per, step = (float(v) for v in np.polyfit(b, s, 1))
        if step <= 0:  # steps proportional to the batch (one decode per request): a line through ~0
            step, per = 1e-6, float((b * s).sum() / (b * b).sum())
        if per < 0:  # no batch dependence measurable
            step, per = float(s.mean()), 0.0
    else:
        step, per = float(s.mean()), 0.0
    return step, per, ctx, fit_errors(b, s, (step, per))


def profile_document(m: Measurement, name: str) -> dict[str, Any]:
    """The YAML mapping of a measured profile (profiles/*.yaml format plus a `measured` section)."""
    import torch

    from testbed.models.spec import load_model_spec

    p = m.plan
    model = load_model_spec(p.model).name  # the spec's name, a plain name: a spec file's path was refused on reading back
    coeffs, degree = fit_prefill_robust(m.prefill)
    step, per, ctx, dec_err = fit_decode(m.decode)
    host = platform.node()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "name": name,
        "chip": m.chip,
        "model": model,
        "gpus_per_instance": 1,
        "provenance": (f"Measured by `prfaas profile` on {host} ({m.chip}), {when}: the {p.variant} variant of {p.model} "
                       f"({m.layers}), random weights (seed {p.seed}), torch {torch.__version__}, {m.clock} time. Prefill: fastest of "
                       f"{p.repeats} run(s) after one untimed run per length; decode: median of {p.decode_steps} steps (after one untimed "
                       f"step) of one batched decode pass (the full variant's per-layer extrapolation: one request x b), fitted at context {ctx}."),
        "prefill": {"points": [[int(n), round(float(s), 6)] for n, s in m.prefill], "degree": degree},
        "decode": {"step_s": float(f"{step:.6g}"), "per_sequence_s": float(f"{per:.6g}"), "max_batch": max(b for b, _, _ in m.decode),
                   "provenance": f"fitted to the batch points at context {ctx}",
                   "points": [[int(b), int(c), round(float(s), 6)] for b, c, s in m.decode]},
        "measured": {
            "host": host, "device": m.device, "variant": p.variant, "base_model": p.model, "depth": p.depth,
            "layers": m.layers, "clock": m.clock, "torch": str(torch.__version__), "threads": torch.get_num_threads(), "date": when,
            "prefill_fit_error": {k: round(v, 5) for k, v in fit_errors(*zip(*m.prefill), coeffs).items()},
            "decode_fit_error": {k: round(v, 5) for k, v in dec_err.items()},
            "kv_bytes": [[int(n), int(b)] for n, b in m.kv_bytes],
            **({"validation": m.validation} if m.validation else {}),
            **({"per_layer": m.per_layer} if m.per_layer else {}),
        },
    }


def write_profile(doc: dict[str, Any], path: Path) -> ComputeProfile:
    """Write `doc` as YAML and read it back through the profile loader (so what is written is loadable)."""
    make_dirs(path.parent)
    write_text(path, yaml.safe_dump(doc, sort_keys=False, width=110))
    from testbed.models.profiles import load_profile

    return load_profile(str(path))


def measured_phi(profile: ComputeProfile, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Phi_kv = S_kv / T_prefill of a measured profile at `lengths`: S_kv of the geometry that ran, T from the
    measured point where there is one, else from the fitted curve (flagged as extrapolated beyond 2x the
    longest measured length)."""
    from testbed.validation import Fields, at_least_one, text

    meas = profile.extra.get("measured") or {}
    if not meas:
        raise UserError(f"{profile.source}: not a measured profile (no `measured` section); write one with `prfaas profile`")
    f = Fields(meas, "measured", profile.source)  # the keys this reads (a `depth: x` was a TypeError traceback, 2026-12-07)
    plan = ProfilePlan(model=f.get("base_model", text), variant=f.choice("variant", ("faithful", "tiny", "full")),
                       depth=f.get("depth", at_least_one, None))
    spec = model_spec(plan)
    points = dict(zip((int(x) for x in profile.points_tokens), profile.points_s))
    longest = max(points) if points else 0
    rows = []
    for n in lengths:
        t = points.get(int(n), float(profile.prefill_time_s(n)))
        rows.append({"tokens": int(n), "kv_bytes": spec.kv_bytes(int(n)).total_bytes, "prefill_s": float(t),
                     "phi_gbps": spec.kv_bytes(int(n)).total_bytes * 8 / float(t) / 1e9,
                     "how": "measured" if int(n) in points else ("curve" if n <= 2 * longest else "extrapolated")})
    return rows
