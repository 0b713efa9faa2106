"""Torch-mode benchmark (issue 12): prefill with a cached prefix, and the slot for decode batching.

    python benchmarks/torch_bench.py [--quick] [--model kimi-linear-48b] [--repeats N] [--json FILE]
                                     [--prefill-speed [--scenario NAME ...]]

Targets (exit status 1 if one is missed):
- **prefill with a cached prefix**: for the tiny and faithful variants, a prefill resumed from the
  prefix pool's block-boundary cache at 25 / 50 / 75% hit takes time proportional to its uncached
  tokens within +-20% (t(hit) / t(0) against (L - hit) / L, measured side by side in one run, the
  fastest of `--repeats` each), through the prefill worker's own path (`TorchCompute.prefill` with a
  `PrefillPlan` from a `HybridPrefixPool` hit). Time is this process's CPU time with one torch thread
  (the compute itself: on the shared 2-core host wall times varied up to 2x between identical runs as
  other jobs came and went); the wall-time ratio is printed beside it;
  Beside it the **work model** (informational): ``T = F + a s + b (s p + s^2 / 2)`` for s new tokens
  after p cached, fitted on full prefills of the suffix lengths and of the prompt, timed in the same
  rounds; its predicted t(hit) / t(0) and the measured ratio's error against it, so a miss shows how
  much of it is the fixed cost per call (F) and the suffix's attention to the prefix (docs/models.md);
- **tokens equal**: at every hit the decode worker's greedy tokens from the KV it would receive (its own
  held prefix joined with the delta the prefill sent) equal those from a full prefill.
- **decode batching** (issue 12 item 2): continuous batching in the decode worker, measured through its own
  step (`TorchCompute.decode_step` over `DecodeSlot`s, one `HybridModel.decode_batch` pass per step), tiny
  variant, context 256, batches 1/2/4/8: TPOT against batch, and tokens/s at batch 8 >= 4x batch 1.

- **prefill speed** (`--prefill-speed`, informational): the tiny paper-1t-hybrid prefill (the quick
  scenario's model) against length, fitted ``T(L) = a L + b L^2``, and each `--scenario`'s own requests
  (its seed and duration, as `prfaas run` draws them) costed with the fit: prompt tokens/s offered
  against what one core and the host's cores can prefill, and the cores the workload needs.

Full variant: prompt 2,048 tokens, 512-token blocks (the worker's), both variants. `--quick`: tiny 1,024
tokens with 256-token blocks, faithful 512 tokens with 128-token blocks (blocks stay multiples of the
linear chunk, so resumption is exact). Run it on a quiet machine (`flock /work/heavy.lock` on a shared one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from testbed.atomic import write_json  # noqa: E402
from testbed.kv.cache import KVCache  # noqa: E402
from testbed.kv.pool import HybridPrefixPool  # noqa: E402
from testbed.serving.compute import PrefillPlan, TorchCompute, join_prefix  # noqa: E402
from testbed.serving.worker import WorkerConfig  # noqa: E402
from testbed.console import wide_console  # noqa: E402
from testbed.validation import output_file_option  # noqa: E402

HITS = (0.25, 0.50, 0.75)
TOLERANCE = 0.20
BATCH_TARGET = 4.0
console = wide_console()


def compute_for(model: str, variant: str) -> TorchCompute:
    cfg = WorkerConfig(role="prefill", instance=0, cluster="prfaas", host="lo", port=0, compute="torch",
                       model={"name": model, "compute": "torch", "variant": variant}, variant=variant, seed=1, device="cpu")
    return TorchCompute(cfg)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed_prefill(comp: TorchCompute, plan: PrefillPlan, ids: list[int]) -> tuple[float, float, list]:
    """(wall s, CPU s of this process, layers). With one torch thread the CPU time is the compute itself;
    on a shared host the wall time also holds the neighbours' share of the cores."""
    got: list = []
    t0, c0 = time.perf_counter(), time.process_time()
    comp.prefill("bench", plan, ids, got.append)
    return time.perf_counter() - t0, time.process_time() - c0, got


def greedy(model, first: int, cache: KVCache, n: int) -> list[int]:
    out = [int(model.decode(first, cache).argmax())]
    while len(out) < n:
        out.append(int(model.decode(out[-1], cache).argmax()))
    return out


def bench_prefix(model: str, variant: str, length: int, block: int, repeats: int) -> dict:
    """t(hit)/t(0) against the uncached share, and token equality, at each hit fraction. The full prefill
    and the resumed ones are timed in turn within each repeat (side by side), after an untimed round."""
    comp = compute_for(model, variant)
    vocab = comp.model.vocab_size
    ids = prompt(length + 1, vocab, 7)  # the last token is the decode's first input: length positions prefilled
    hashes = list(range(1000, 1000 + length // block))
    spec = comp.model.spec
    state = spec.kv_bytes(block).fixed_state_bytes + spec.kv_bytes(block).window_bytes
    pool = HybridPrefixPool(1 << 40, block, store_tensors=True, hybrid=state > 0)
    hit_tokens = [int(length * frac) // block * block for frac in HITS]
    for n in hit_tokens:  # earlier prompts that ended on these boundaries leave their caches in the pool
        out = comp.prefill("seed", PrefillPlan(n + 1, 0, 0, n), ids[:n + 1], lambda _layer: None)
        pool.insert(hashes, out.checkpoint)
    hits = [pool.match(hashes, max_tokens=n, acquire=True) for n in hit_tokens]
    assert [h.tokens for h in hits] == hit_tokens, [h.tokens for h in hits]
    plans = [PrefillPlan(length + 1)] + [PrefillPlan(length + 1, h.tokens, h.tokens, None, h.cache) for h in hits]
    # the work model's points: full prefills (no prefix) as long as each uncached suffix
    short = [length - n for n in hit_tokens]
    plans += [PrefillPlan(n + 1) for n in short]
    prompts = [ids] * (1 + len(hits)) + [ids[:n + 1] for n in short]
    best = [float("inf")] * len(plans)
    best_wall = [float("inf")] * len(plans)
    layers: list[list] = [[] for _ in plans]
    for r in range(repeats + 1):  # round 0 is untimed: allocator and kernel warm-up at these shapes
        for i, plan in enumerate(plans):
            wall, cpu, got = timed_prefill(comp, plan, prompts[i])
            if r:
                best[i], best_wall[i] = min(best[i], cpu), min(best_wall[i], wall)
            layers[i] = got
    model = work_model([length] + short, [best[0]] + best[1 + len(hits):])
    want = greedy(comp.model, ids[-1], KVCache("f", spec.name, length, list(layers[0])), 4)
    rows = []
    for frac, h, t, wall, delta in zip(HITS, hits, best[1:], best_wall[1:], layers[1:]):
        # the decode holds the same prefix (its pool's full-attention blocks) and is sent only the rest
        held = KVCache("d", spec.name, h.tokens, [layer for layer in h.cache.layers if layer.kind in ("gqa", "mla")])
        got = greedy(comp.model, ids[-1], join_prefix(held, KVCache("r", spec.name, length, list(delta))), 4)
        pool.release(h)
        expected = (length - h.tokens) / length
        predicted = model.predict_s(length - h.tokens, h.tokens) / model.predict_s(length, 0)
        rows.append({"variant": variant, "length": length, "hit_tokens": h.tokens, "hit": frac, "prefill_s": t,
                     "full_prefill_s": best[0], "wall_s": wall, "full_wall_s": best_wall[0], "wall_ratio": wall / best_wall[0],
                     "time_ratio": t / best[0], "uncached_ratio": expected,
                     "error": (t / best[0]) / expected - 1.0, "tokens_equal": got == want,
                     "model_ratio": predicted, "model_error": (t / best[0]) / predicted - 1.0,
                     "sent_bytes": sum(layer.nbytes for layer in delta)})
    return {"variant": variant, "rows": rows, "work_model": model.as_dict(length)}


class WorkModel:
    """Prefill CPU time of ``s`` new tokens after ``p`` cached ones, fitted on full prefills (p = 0) of
    several lengths: ``F + a s + b (s p + s^2 / 2)``. F is the cost per call that no token count explains
    (per-layer setup: ~80 Python-dispatched operations a layer on the tiny variant), ``a s`` everything
    per token (projections, MLPs, the linear layers' chunk chain), ``b x pairs`` full attention (a
    suffix attends to the prefix and causally to itself). What "time proportional to the uncached
    tokens" leaves out is F and the prefix part of the pairs: docs/models.md, "Prefill with a cached
    prefix: the work model"."""

    def __init__(self, fixed_s: float, per_token_s: float, per_pair_s: float) -> None:
        self.fixed_s, self.per_token_s, self.per_pair_s = fixed_s, per_token_s, per_pair_s
        self.fit_error = 0.0  # largest relative residual on the full prefills it was fitted on

    def predict_s(self, new_tokens: int, cached_tokens: int) -> float:
        pairs = new_tokens * cached_tokens + new_tokens * new_tokens / 2
        return self.fixed_s + self.per_token_s * new_tokens + self.per_pair_s * pairs

    def as_dict(self, length: int) -> dict:
        full = self.predict_s(length, 0)
        return {"fixed_s": self.fixed_s, "per_token_s": self.per_token_s, "per_pair_s": self.per_pair_s,
                "full_length": length, "fit_error": self.fit_error, "fixed_share": self.fixed_s / full,
                "token_share": self.per_token_s * length / full, "pair_share": self.per_pair_s * length * length / 2 / full}


def work_model(lengths: list[int], cpu_s: list[float]) -> WorkModel:
    """Non-negative least squares of full-prefill CPU times (no prefix) on ``[1, L, L^2 / 2]`` (no term can
    be a negative cost; one the noise would make negative is 0)."""
    import numpy as np
    from scipy.optimize import nnls

    x = np.asarray(lengths, dtype=float)
    cols = np.stack([np.ones_like(x), x, x * x / 2], axis=1)
    norm = cols.max(axis=0)  # columns of one scale: the solver's tolerance is absolute
    (f, a, b), _ = nnls(cols / norm, np.asarray(cpu_s, dtype=float))
    f, a, b = f / norm[0], a / norm[1], b / norm[2]
    model = WorkModel(float(f), float(a), float(b))
    model.fit_error = max(abs(model.predict_s(n, 0) / t - 1.0) for n, t in zip(lengths, cpu_s))
    return model


def decode_batching_figure(model: str = "kimi-linear-48b", variant: str = "tiny", context: int = 256,
                           steps: int = 8) -> dict:
    """Decode tokens/s at batch 8 against batch 1 and TPOT per batch, through the decode worker's step
    (`TorchCompute.decode_step` over `DecodeSlot`s: one batched pass per step, each request on its own cache)."""
    from testbed.models.torch_model import synthetic_cache
    from testbed.serving.protocol import DecodeRequest
    from testbed.serving.worker import DecodeSlot

    comp = compute_for(model, variant)
    out = {}
    for b in (1, 2, 4, 8):
        slots = []
        for i in range(b):
            s = DecodeSlot(DecodeRequest(f"b{i}", 3, prompt_token_ids=(1, 2)))
            s.kv = synthetic_cache(comp.model.spec, context, seed=i)
            comp.admit(s)  # as the decode worker does: checked when the KV arrives, placed as it joins
            comp.place(s)
            slots.append(s)
        comp.decode_step(slots)  # warm-up (the first step feeds the prompt's last token)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            comp.decode_step(slots)
        dt, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
        out[b] = {"tpot_s": cpu, "tokens_per_s": b / cpu, "wall_tpot_s": dt}  # judged on CPU time, as the prefill
    return {"by_batch": out, "ratio_8_to_1": out[8]["tokens_per_s"] / out[1]["tokens_per_s"]}


def prefill_speed_figure(model: str = "paper-1t-hybrid", variant: str = "tiny",
                         lengths: tuple[int, ...] = (1024, 4096, 16384), repeats: int = 1) -> dict:
    """Prefill CPU time against prompt length through the prefill worker's path (`TorchCompute.prefill`,
    one torch thread, the fastest of `repeats` after an untimed short run), and the fit
    ``T(L) = a L + b L^2`` (linear layers, MLPs: per token; full attention: per token pair)."""
    import numpy as np

    comp = compute_for(model, variant)
    vocab = comp.model.vocab_size
    comp.prefill("warm", PrefillPlan(257), prompt(257, vocab, 3), lambda _layer: None)
    points = []
    for n in lengths:
        ids = prompt(n + 1, vocab, 11)  # n positions prefilled; the last token is the decode's first input
        best = min(timed_prefill(comp, PrefillPlan(n + 1), ids)[1] for _ in range(max(1, repeats)))
        points.append({"tokens": n, "cpu_s": best, "tokens_per_s": n / best})
    x = np.array([p["tokens"] for p in points], dtype=float)
    (a, b), *_ = np.linalg.lstsq(np.stack([x, x * x], axis=1), np.array([p["cpu_s"] for p in points]), rcond=None)
    return {"model": model, "variant": variant, "points": points, "a_s_per_token": float(a), "b_s_per_token2": float(b)}


def scenario_demand(scenario: str, fit: dict) -> dict:
    """The prefill compute a scenario's workload asks of this host in torch mode: its own requests (the
    scenario's seed and duration, as `prfaas run` draws them) costed with the fit, against the cores."""
    import numpy as np

    from testbed.sections import load_scenario
    from traffic.workload import generate_batch

    sc = load_scenario(scenario)
    lengths = np.asarray(generate_batch(sc.section("workload"), sc.seed, sc.duration_s).input_len, dtype=float) - 1
    cpu_s = float(np.sum(fit["a_s_per_token"] * lengths + fit["b_s_per_token2"] * lengths**2))
    cores = os.cpu_count() or 1
    return {"scenario": scenario, "requests": int(lengths.size), "duration_s": sc.duration_s,
            "prompt_tokens": int(lengths.sum()), "offered_tokens_per_s": float(lengths.sum()) / sc.duration_s,
            "core_tokens_per_s": float(lengths.sum()) / cpu_s, "host_tokens_per_s": cores * float(lengths.sum()) / cpu_s,
            "prefill_cpu_s": cpu_s, "cores_needed": cpu_s / sc.duration_s, "cores": cores,
            "longest": int(lengths.max()), "rms_tokens": float(np.sqrt(np.mean(lengths**2)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter prompts and smaller blocks")
    ap.add_argument("--model", default="kimi-linear-48b")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per point, fastest kept (default 5)")
    ap.add_argument("--json", type=output_file_option, metavar="FILE")
    ap.add_argument("--prefill-speed", action="store_true",
                    help="also time the tiny paper-1t-hybrid prefill against length and cost each --scenario's workload with it")
    ap.add_argument("--scenario", action="append", default=None, help="scenario for --prefill-speed (default: quick, torch-quick)")
    args = ap.parse_args(argv)
    args.scenario = args.scenario or ["quick", "torch-quick"]
    torch.set_num_threads(1)
    cases = [("tiny", 1024, 256), ("faithful", 512, 128)] if args.quick else [("tiny", 2048, 512), ("faithful", 2048, 512)]
    results, failures = [], []
    for variant, length, block in cases:
        with console.status(f"{variant}: prefill of {length} tokens at 0/25/50/75% hit"):
            results.append(bench_prefix(args.model, variant, length, block, max(1, args.repeats)))
    table = Table(title=f"Prefill with a cached prefix, {args.model}, {torch.get_num_threads()} torch thread, fastest of {args.repeats} "
                        "(judged on this process's CPU time; wall time beside it)")
    for col in ("variant", "tokens", "hit", "CPU s", "full CPU s", "t/t_full", "uncached share", "error", "wall t/t_full",
                "tokens equal", "target", "work model", "vs model"):
        table.add_column(col, justify="right")
    for r in (row for res in results for row in res["rows"]):
        ok = abs(r["error"]) <= TOLERANCE and r["tokens_equal"]
        if not ok:
            failures.append(f"{r['variant']} at {r['hit']:.0%} hit: time ratio {r['time_ratio']:.3f} vs {r['uncached_ratio']:.3f} "
                            f"({r['error']:+.1%}), tokens equal: {r['tokens_equal']}")
        table.add_row(r["variant"], str(r["length"]), f"{r['hit']:.0%} ({r['hit_tokens']})", f"{r['prefill_s']:.3f}",
                      f"{r['full_prefill_s']:.3f}", f"{r['time_ratio']:.3f}", f"{r['uncached_ratio']:.3f}", f"{r['error']:+.1%}",
                      f"{r['wall_ratio']:.3f}", str(r["tokens_equal"]), "met" if ok else "MISSED", f"{r['model_ratio']:.3f}",
                      f"{r['model_error']:+.1%}" + ("" if abs(r["model_error"]) <= TOLERANCE else " (off)"))
    console.print(table)
    for res in results:
        w = res["work_model"]
        console.print(f"Work model, {res['variant']} (fitted on full prefills of the suffix lengths and {w['full_length']:,} tokens; "
                      f"informational, the target above is judged on the uncached share): T(s new after p cached) = "
                      f"{w['fixed_s'] * 1e3:.2f} ms + {w['per_token_s'] * 1e6:.1f} us x s + {w['per_pair_s'] * 1e9:.2f} ns x (s p + s^2/2); "
                      f"a full {w['full_length']:,}-token prefill is {w['fixed_share']:.0%} per call, {w['token_share']:.0%} per token, "
                      f"{w['pair_share']:.0%} attention pairs; fit residual at most {w['fit_error']:.1%}")
    doc = {"prefix": results}
    with console.status("decode batching (batch 1..8)"):
        batching = decode_batching_figure()
    doc["decode_batching"] = batching
    console.print("Decode, tiny variant, context 256, through TorchCompute.decode_step (CPU time; wall beside): " + ", ".join(
        f"batch {b}: TPOT {v['tpot_s'] * 1e3:.1f} ms (wall {v['wall_tpot_s'] * 1e3:.1f}), {v['tokens_per_s']:.0f} tok/s"
        for b, v in batching["by_batch"].items())
        + f"; batch 8 / batch 1 = {batching['ratio_8_to_1']:.2f}x (target >= {BATCH_TARGET:g}x)")
    if args.prefill_speed:
        lengths = (1024, 4096, 16384) if args.quick else (1024, 4096, 16384, 32768)
        with console.status(f"prefill speed, paper-1t-hybrid tiny, {lengths} tokens"):
            speed = prefill_speed_figure(lengths=lengths)
        demands = [scenario_demand(name, speed) for name in args.scenario]
        doc["prefill_speed"], doc["scenario_demand"] = speed, demands
        console.print("Prefill, paper-1t-hybrid tiny, one torch thread, CPU time: " + ", ".join(
            f"{p['tokens']:,} tokens {p['cpu_s']:.2f} s ({p['tokens_per_s']:,.0f} tok/s)" for p in speed["points"])
            + f"; fit T(L) = {speed['a_s_per_token'] * 1e6:.0f} us x L + {speed['b_s_per_token2'] * 1e9:.1f} ns x L^2")
        t = Table(title="Torch-mode prefill the scenario's own requests ask of this host (fit above; informational, not a target)")
        for col in ("scenario", "requests", "prompt tokens", "offered tok/s", "one core tok/s (this mix)", "host tok/s at most",
                    "prefill CPU s", "cores needed", "cores"):
            t.add_column(col, justify="right")
        for d in demands:
            t.add_row(d["scenario"], str(d["requests"]), f"{d['prompt_tokens']:,}", f"{d['offered_tokens_per_s']:,.0f}",
                      f"{d['core_tokens_per_s']:,.0f}", f"{d['host_tokens_per_s']:,.0f}", f"{d['prefill_cpu_s']:.1f}",
                      f"{d['cores_needed']:.2f}", str(d["cores"]))
        console.print(t)
    if batching["ratio_8_to_1"] < BATCH_TARGET:
        failures.append(f"decode batch 8 / batch 1 = {batching['ratio_8_to_1']:.2f}x < {BATCH_TARGET:g}x")
    if args.json:
        write_json(args.json, doc, indent=1)
    for f in failures:
        console.print(f"[red]target missed[/red]: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
