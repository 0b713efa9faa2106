"""The paper's analytical throughput model (Eqs. 3-8) and its exhaustive grid search, vectorised with numpy.

Who knows what: `LengthDistribution` knows the uncached input length L (p, l_long, l_short and the
conditional means of any function of L); `ClusterModel` knows the clusters (profiles, instance counts,
egress, KV bytes, decode); `stage_throughputs` evaluates Eqs. 3-6 on a whole (t, N_p) grid at once;
`search_prfaas_pd` / `homogeneous_pd` / `naive_heterogeneous` return one `ModelResult` each.

Eq. 3 has two readings (see docs/analysis.md): ``literal`` evaluates T_prefill at the conditional mean
length (T(l_long), as printed), ``mean`` uses the mean prefill time over the requests actually routed
there (E[T(L) | L > t]), which is what a server busy with those requests really sustains. Both are
computed; ``literal`` is the primary one because it is what the paper writes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from scipy import special

from testbed.errors import UserError
from testbed.models.profiles import ComputeProfile, load_profile

if TYPE_CHECKING:
    from testbed.models.spec import ModelSpec
    from traffic.request import RequestBatch

READINGS = ("literal", "mean")
KvBytesFn = Callable[[np.ndarray], np.ndarray]


# ------------------------------------------------------------------------------------ length distribution


@dataclass(frozen=True)
class LengthDistribution:
    """A discrete distribution of uncached input lengths: sorted support points and their probabilities."""

    lengths: np.ndarray
    weights: np.ndarray
    description: str = ""

    @classmethod
    def truncated_lognormal(cls, mu: float, sigma: float, lo: float, hi: float, bins: int = 8192) -> "LengthDistribution":
        """Log-normal(mu, sigma) truncated to [lo, hi], in `bins` log-spaced bins.

        Each bin's point is its exact conditional mean, so p and the first moments are exact at bin edges.
        """
        if not (sigma > 0 and 0 < lo < hi):
            raise UserError("truncated log-normal needs sigma > 0 and 0 < lo < hi")
        edges = np.exp(np.linspace(math.log(lo), math.log(hi), bins + 1))
        z = (np.log(edges) - mu) / sigma
        cdf = special.ndtr(z)
        partial = math.exp(mu + sigma**2 / 2) * special.ndtr(z - sigma)  # E[X; X < edge] (untruncated)
        w = np.diff(cdf)
        m = np.diff(partial)
        ok = w > 0
        pts = np.where(ok, m / np.where(ok, w, 1), (edges[:-1] + edges[1:]) / 2)
        if w.sum() <= 0:
            raise UserError("truncated log-normal: no probability mass inside [lo, hi]")
        return cls(pts, w / w.sum(), f"truncated log-normal mu={mu:g} sigma={sigma:g} on [{lo:g}, {hi:g}]")

    @classmethod
    def from_samples(cls, lengths: Any, description: str = "empirical") -> "LengthDistribution":
        x = np.asarray(lengths, dtype=float)
        if x.size == 0 or np.any(~np.isfinite(x)) or np.any(x < 0):
            raise UserError("empirical length distribution: need at least one finite length >= 0")
        u, c = np.unique(x, return_counts=True)
        return cls(u, c / c.sum(), f"{description} ({x.size} samples)")

    @classmethod
    def fixed(cls, length: float) -> "LengthDistribution":
        return cls(np.array([float(length)]), np.array([1.0]), f"fixed {length:g}")

    @property
    def mean(self) -> float:
        return float(self.lengths @ self.weights)

    def split(self, thresholds: Any, values: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each t: (p = P(L > t), E[g(L) | L <= t], E[g(L) | L > t]) with g(L) = `values` (default L).

        Undefined conditional means (empty side) are NaN.
        """
        t = np.asarray(thresholds, dtype=float)
        g = self.lengths if values is None else np.asarray(values, dtype=float)
        cw = np.concatenate(([0.0], np.cumsum(self.weights)))
        cg = np.concatenate(([0.0], np.cumsum(self.weights * g)))
        i = np.searchsorted(self.lengths, t, side="right")
        w_le, g_le = cw[i], cg[i]
        w_gt, g_gt = cw[-1] - w_le, cg[-1] - g_le
        with np.errstate(invalid="ignore", divide="ignore"):
            short = np.where(w_le > 1e-15, g_le / np.where(w_le > 0, w_le, 1), np.nan)
            long = np.where(w_gt > 1e-15, g_gt / np.where(w_gt > 0, w_gt, 1), np.nan)
        p = np.clip(w_gt / cw[-1], 0.0, 1.0)
        return p, short, long


# ------------------------------------------------------------------------------------------- the clusters


def affine_kv_bytes(fixed_bytes: float, bytes_per_token: float) -> KvBytesFn:
    return lambda l: fixed_bytes + bytes_per_token * np.asarray(l, dtype=float)


def spec_kv_bytes(model: str | ModelSpec, kv_dtype: str | None = None) -> KvBytesFn:
    """S_kv(l) from the model spec (`testbed.models.spec`), the one place that knows a model's geometry: `model` is a
    spec, or a preset's name or a spec file to load; `kv_dtype`: its full-attention KV in that dtype instead
    (`policy.kv_compression`'s float8). A scenario's is its `model` section's spec (`ModelSection.spec`: the file found
    beside the scenario, with its `state_dtype`); loading it again by name lost both (2026-12-07).

    The spec is evaluated at powers of two (1 .. 2^21 tokens) and interpolated linearly: KV bytes are
    piecewise linear in l with knees only at sliding-window sizes, which are powers of two in every preset.
    """
    from testbed.models.spec import load_model_spec

    spec = load_model_spec(model) if isinstance(model, str) else model
    anchors = np.array([0.0] + [2.0**k for k in range(22)])
    vals = np.array([float(spec.kv_bytes(int(a), full_attention_dtype=kv_dtype).total_bytes) for a in anchors])
    slope = (vals[-1] - vals[-2]) / (anchors[-1] - anchors[-2])

    def kv(l: Any) -> np.ndarray:
        x = np.asarray(l, dtype=float)
        return np.where(x <= anchors[-1], np.interp(x, anchors, vals), vals[-1] + slope * (x - anchors[-1]))

    return kv


@dataclass(frozen=True)
class ClusterModel:
    """Inputs of Eqs. 3-6 other than the length distribution."""

    pd_profile: ComputeProfile
    n_pd: int  # N_p + N_d, instances in the local PD cluster
    kv_bytes: KvBytesFn
    output_len: float  # L_out, mean output tokens
    prfaas_profile: ComputeProfile | None = None
    n_prfaas: int = 0
    egress_bps: float = math.inf  # B_out, PrfaaS egress (WAN) capacity
    bs_max: int | None = None  # default: pd_profile.decode.max_batch
    t_decode_s: float | None = None  # default: pd_profile.decode_step_s(bs_max)
    name: str = ""

    @property
    def decode_batch(self) -> int:
        return int(self.bs_max if self.bs_max is not None else self.pd_profile.max_batch)

    @property
    def decode_step(self) -> float:
        return float(self.t_decode_s if self.t_decode_s is not None else self.pd_profile.decode_step_s(self.decode_batch))

    def theta_pdd(self, n_d: Any) -> np.ndarray:
        """Eq. 5: decode throughput (requests/s) of n_d decode instances."""
        return np.asarray(n_d, dtype=float) * self.decode_batch / (self.decode_step * self.output_len)

    def profiles_not_of(self, model: str) -> list[tuple[str, ComputeProfile]]:
        """(cluster, profile) of each profile whose times are not `model`'s (`profiles.is_of_model`): `prfaas model`
        refuses them, `prfaas check` warns of them for a torch-mode run."""
        from testbed.models.profiles import is_of_model

        return [(c, p) for c, p in (("prfaas", self.prfaas_profile), ("pd", self.pd_profile))
                if p is not None and not is_of_model(p, model)]


# -------------------------------------------------------------------------------------------- equations


@dataclass
class StageGrid:
    """Eqs. 3-6 on a grid: arrays of shape (len(thresholds), len(n_p))."""

    thresholds: np.ndarray
    n_p: np.ndarray
    p: np.ndarray
    l_short: np.ndarray
    l_long: np.ndarray
    theta_prfaas: np.ndarray
    theta_pdp: np.ndarray
    theta_pdd: np.ndarray
    lambda_max: np.ndarray
    kv_long_bytes: np.ndarray  # E[S_kv(L) | L > t] (or S_kv(l_long)), bytes per offloaded request
    theta_egress: np.ndarray  # B_out / S_kv: the egress term of Eq. 3 alone


def stage_throughputs(cm: ClusterModel, dist: LengthDistribution, thresholds: Any, n_p: Any, reading: str = "literal") -> StageGrid:
    """Eqs. 3-6 for every threshold t and every N_p (N_d = n_pd - N_p)."""
    if reading not in READINGS:
        raise UserError(f"reading {reading!r}: use one of {', '.join(READINGS)}")
    t = np.atleast_1d(np.asarray(thresholds, dtype=float))
    npf = np.atleast_1d(np.asarray(n_p, dtype=float))
    L = dist.lengths
    p, l_short, l_long = dist.split(t)
    if reading == "literal":  # T and S_kv at the conditional mean lengths, as Eqs. 3-4 are printed
        ll = np.nan_to_num(l_long)
        t_long = cm.prfaas_profile.prefill_time_s(ll) if cm.prfaas_profile else np.full_like(t, np.nan)
        t_short = cm.pd_profile.prefill_time_s(np.nan_to_num(l_short))
        s_long = cm.kv_bytes(ll)
    else:  # mean over the requests each side receives: E[T(L) | L > t], E[T(L) | L <= t], E[S_kv(L) | L > t]
        t_long = dist.split(t, cm.prfaas_profile.prefill_time_s(L))[2] if cm.prfaas_profile else np.full_like(t, np.nan)
        t_short = dist.split(t, cm.pd_profile.prefill_time_s(L))[1]
        s_long = dist.split(t, cm.kv_bytes(L))[2]
    with np.errstate(divide="ignore", invalid="ignore"):
        # Eq. 3: PrfaaS is min(compute rate, egress rate); Eq. 4: PD-P (intra-cluster RDMA never binds)
        theta_egress = cm.egress_bps / (8.0 * np.asarray(s_long))
        theta_prfaas = np.minimum(cm.n_prfaas / t_long, theta_egress) if cm.n_prfaas else np.zeros_like(t)
        theta_prfaas = np.where(p > 0, theta_prfaas, np.nan)
        theta_pdp = npf[None, :] / np.asarray(t_short)[:, None]
        theta_pdp = np.where((1 - p)[:, None] > 0, theta_pdp, np.nan)
        theta_pdd = np.broadcast_to(cm.theta_pdd(cm.n_pd - npf)[None, :], theta_pdp.shape)
        # Eq. 6: a stage that receives no requests does not limit Lambda
        lim_prfaas = np.where(p > 0, np.nan_to_num(theta_prfaas) / p, np.inf)[:, None]
        lim_pdp = np.where((1 - p)[:, None] > 0, np.nan_to_num(theta_pdp) / (1 - p)[:, None], np.inf)
        lam = np.minimum(np.minimum(lim_prfaas, lim_pdp), theta_pdd)
    return StageGrid(t, npf, p, l_short, l_long, np.broadcast_to(theta_prfaas[:, None], lam.shape), theta_pdp, theta_pdd, lam,
                     np.asarray(s_long), np.asarray(theta_egress))


# -------------------------------------------------------------------------------------------- results


@dataclass
class ModelResult:
    """One configuration at its optimum. Rates in requests/s, egress in Gbps (10^9 bit/s)."""

    configuration: str
    reading: str
    threshold: float | None
    offload_fraction: float
    l_short: float | None
    l_long: float | None
    n_prfaas: int
    n_p: int
    n_d: int
    theta_prfaas: float | None
    theta_pdp: float | None
    theta_pdd: float
    lambda_max: float
    egress_gbps: float
    egress_capacity_gbps: float | None
    bottleneck: str
    grid: StageGrid | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "grid"}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _f(x: Any) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def _result(configuration: str, cm: ClusterModel, g: StageGrid, i: int, j: int, reading: str, threshold: float | None) -> ModelResult:
    p = float(g.p[i])
    lam = float(g.lambda_max[i, j])
    th_pf = _f(g.theta_prfaas[i, j]) if p > 0 else None
    th_pdp = _f(g.theta_pdp[i, j]) if p < 1 else None
    th_pdd = float(g.theta_pdd[i, j])
    lim = {"prfaas": th_pf / p if th_pf is not None else math.inf, "pd-p": th_pdp / (1 - p) if th_pdp is not None else math.inf, "pd-d": th_pdd}
    bottleneck = min(lim, key=lambda k: lim[k])
    if bottleneck == "prfaas" and th_pf is not None and float(g.theta_egress[i]) <= th_pf * (1 + 1e-12):
        bottleneck = "egress"  # Eq. 3's bandwidth term, not compute, limits PrfaaS
    egress_bps = lam * p * float(g.kv_long_bytes[i]) * 8 if p > 0 else 0.0
    return ModelResult(
        configuration=configuration,
        reading=reading,
        threshold=threshold,
        offload_fraction=p,
        l_short=_f(g.l_short[i]) if p < 1 else None,
        l_long=_f(g.l_long[i]) if p > 0 else None,
        n_prfaas=cm.n_prfaas if p > 0 else 0,
        n_p=int(g.n_p[j]),
        n_d=int(cm.n_pd - g.n_p[j]),
        theta_prfaas=th_pf,
        theta_pdp=th_pdp,
        theta_pdd=th_pdd,
        lambda_max=lam,
        egress_gbps=egress_bps / 1e9,
        egress_capacity_gbps=cm.egress_bps / 1e9 if p > 0 and math.isfinite(cm.egress_bps) else None,
        bottleneck=bottleneck,
        grid=g,
    )


def threshold_grid(dist: LengthDistribution, step_tokens: float = 64.0) -> np.ndarray:
    """Candidate thresholds: 0 (offload all) to the longest length (offload none) every `step_tokens`."""
    hi = float(dist.lengths.max())
    return np.unique(np.concatenate((np.arange(0.0, hi, step_tokens), [hi])))


def search_prfaas_pd(cm: ClusterModel, dist: LengthDistribution, reading: str = "literal", step_tokens: float = 64.0) -> ModelResult:
    """Exhaustive 2-D grid search over t and the N_p / N_d split maximising Lambda_max (Eq. 6).

    Ties (Lambda flat in t when decode binds) go to the point that best satisfies Eq. 7, then to the lower
    egress: the paper's optimum satisfies Eq. 7 and Eq. 8 together.
    """
    if cm.prfaas_profile is None or cm.n_prfaas < 1:
        raise UserError("PrfaaS-PD needs a PrfaaS profile and at least one PrfaaS instance")
    if cm.n_pd < 2:
        raise UserError("PrfaaS-PD needs at least 2 PD instances (one prefill, one decode)")
    g = stage_throughputs(cm, dist, threshold_grid(dist, step_tokens), np.arange(0, cm.n_pd + 1), reading)
    best = np.nanmax(g.lambda_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        imb7 = np.abs(np.log((g.theta_prfaas / g.p[:, None]) / (g.theta_pdp / (1 - g.p)[:, None])))
    imb7 = np.where(np.isfinite(imb7), imb7, np.inf)
    cand = np.argwhere(g.lambda_max >= best * (1 - 1e-9))
    i, j = min(cand, key=lambda ij: (imb7[ij[0], ij[1]], g.p[ij[0]], ij[1]))
    return _result("prfaas_pd", cm, g, int(i), int(j), reading, float(g.thresholds[i]))


def at_threshold(cm: ClusterModel, dist: LengthDistribution, threshold: float, reading: str = "literal") -> ModelResult:
    """A fixed threshold t (e.g. the ``fixed-threshold`` policy): Eqs. 3-6 at that t, best N_p / N_d split."""
    g = stage_throughputs(cm, dist, [float(threshold)], np.arange(0, cm.n_pd + 1), reading)
    j = int(np.nanargmax(g.lambda_max[0]))
    return _result("fixed_threshold", cm, g, 0, j, reading, float(threshold))


def homogeneous_pd(cm: ClusterModel, dist: LengthDistribution, reading: str = "literal") -> ModelResult:
    """Baseline: one PD cluster, every request prefilled locally (p = 0); best N_p / N_d split."""
    local = replace(cm, prfaas_profile=None, n_prfaas=0)
    g = stage_throughputs(local, dist, [math.inf], np.arange(0, cm.n_pd + 1), reading)
    j = int(np.nanargmax(g.lambda_max[0]))
    return _result("homogeneous_pd", local, g, 0, j, reading, None)


def naive_heterogeneous(cm: ClusterModel, dist: LengthDistribution, reading: str = "literal") -> ModelResult:
    """Baseline: every prefill on the PrfaaS cluster (p = 1, no length routing), every PD instance decodes."""
    if cm.prfaas_profile is None or cm.n_prfaas < 1:
        raise UserError("naive heterogeneous PD needs a PrfaaS profile and at least one PrfaaS instance")
    g = stage_throughputs(cm, dist, [-1.0], [0], reading)
    return _result("naive_heterogeneous", cm, g, 0, 0, reading, None)


# -------------------------------------------------------------------------------------------- case study

CASE_STUDY_INPUTS = {
    "prfaas": "4 instances x 8 H200 (32 GPUs), profile h200-paper-1t-hybrid",
    "pd": "8 instances x 8 H20 (64 GPUs), profile h20-paper-1t-hybrid",
    "egress": "100 Gbps VPC between the clusters",
    "model": "paper-1t-hybrid (KV bytes from its spec)",
    "lengths": "input truncated log-normal mu 9.90 sigma 1.00 on [128, 128K]; output 1024 tokens",
    "decode": "BS_max 20 at 25 ms per step (DERIVED assumption)",
    "homogeneous_pd": "12 instances x 8 H20 (96 GPUs)",
    "naive_heterogeneous": "4 H200 instances prefill everything, 8 H20 instances decode",
}


def paper_case_study(kv_bytes: KvBytesFn | None = None) -> tuple[ClusterModel, ClusterModel, LengthDistribution]:
    """(PrfaaS-PD cluster model, homogeneous 12-instance PD cluster model, length distribution) of the paper's case study."""
    kv = kv_bytes or spec_kv_bytes("paper-1t-hybrid")
    h20 = load_profile("h20-paper-1t-hybrid")
    cm = ClusterModel(pd_profile=h20, n_pd=8, kv_bytes=kv, output_len=1024, prfaas_profile=load_profile("h200-paper-1t-hybrid"), n_prfaas=4, egress_bps=100e9, name="paper case study")
    homo = ClusterModel(pd_profile=h20, n_pd=12, kv_bytes=kv, output_len=1024, name="homogeneous PD, 96 H20")
    dist = LengthDistribution.truncated_lognormal(9.90, 1.00, 128, 128 * 1024)
    return cm, homo, dist


def evaluate(cm: ClusterModel, homo: ClusterModel, dist: LengthDistribution, reading: str = "literal", step_tokens: float = 64.0) -> dict[str, ModelResult]:
    """All three configurations under one reading of Eq. 3."""
    return {
        "prfaas_pd": search_prfaas_pd(cm, dist, reading, step_tokens),
        "homogeneous_pd": homogeneous_pd(homo, dist, reading),
        "naive_heterogeneous": naive_heterogeneous(cm, dist, reading),
    }


SECTION_KEYS = {
    "prfaas_pd": ("threshold", "offload_fraction", "theta_prfaas", "theta_pdp", "theta_pdd", "lambda_max", "egress_gbps"),
    "homogeneous_pd": ("offload_fraction", "theta_pdp", "theta_pdd", "lambda_max"),
    "naive_heterogeneous": ("offload_fraction", "theta_prfaas", "theta_pdd", "lambda_max", "egress_gbps"),
}


def results_json(primary: dict[str, ModelResult], other: dict[str, ModelResult], inputs: dict[str, str]) -> dict[str, Any]:
    """The `prfaas model --json` document: one section per configuration, the other reading beside it."""
    out: dict[str, Any] = {"inputs": inputs, "reading": primary["prfaas_pd"].reading}
    for name, r in primary.items():
        d = r.to_dict()
        sec = {k: d[k] for k in SECTION_KEYS[name]}
        sec.update({k: d[k] for k in ("n_prfaas", "n_p", "n_d", "l_short", "l_long", "bottleneck", "egress_capacity_gbps")})
        sec["lambda_max_units"] = "requests/s"
        sec["other_reading"] = {"reading": other[name].reading, **{k: other[name].to_dict()[k] for k in SECTION_KEYS[name]}}
        out[name] = sec
    base = primary["homogeneous_pd"].lambda_max
    out["speedup_vs_homogeneous_pd"] = {k: (r.lambda_max / base if base > 0 else None) for k, r in primary.items()}
    return out


# -------------------------------------------------------------------------------------------- scenarios


def length_distribution(dist: Any, seed: int = 1, samples: int = 200_000) -> LengthDistribution:
    """The model's view of a workload length distribution (`traffic.lengths`): analytic for the truncated
    log-normal, otherwise `samples` draws with a fixed seed."""
    if all(hasattr(dist, k) for k in ("mu", "sigma", "low", "high")):
        return LengthDistribution.truncated_lognormal(dist.mu, dist.sigma, dist.low, dist.high)
    return LengthDistribution.from_samples(dist.sample(np.random.default_rng(seed), samples), type(dist).__name__)


def workload_lengths(sc: Any, workload: Any, batch: "RequestBatch | None" = None) -> tuple[LengthDistribution, float]:
    """(input lengths, mean output length) of a scenario's workload: its ``input`` and ``output``
    distributions, or, replaying a trace, the requests the run sends (those arriving within its duration):
    `batch` where the caller has drawn them (``generate_batch(workload, sc.seed, sc.duration_s)``), else drawn here."""
    if workload.trace is None:
        return length_distribution(workload.input, sc.seed), float(workload.output.mean())
    if batch is None:
        from traffic.workload import generate_batch

        batch = generate_batch(workload, sc.seed, sc.duration_s)
    if not len(batch.input_len):
        raise UserError(f"workload.trace: no request of {workload.trace.path} arrives within the run's {sc.duration_s:g} s")
    name = f"trace {Path(workload.trace.path).name}, the {len(batch.input_len)} requests a {sc.duration_s:g}-s run sends"
    return LengthDistribution.from_samples(batch.input_len, name), float(np.mean(batch.output_len))


def _scenario_profile(serving: Any, cluster: str, model_name: str) -> str:
    """``serving.profiles.<cluster>``, else the chip's profile for this model (``h200-<model>`` / ``h20-<model>``),
    the same default as the serving plane."""
    name = serving.profile(cluster)
    if name:
        return name
    from testbed.models.profiles import available_profiles

    name = f"{'h200' if cluster == 'prfaas' else 'h20'}-{model_name}"
    if name not in available_profiles():
        raise UserError(f"serving.profiles.{cluster}: not set and there is no profile {name!r}; ready: {', '.join(available_profiles())}")
    return name


def cluster_model_from_scenario(sc: Any, batch: "RequestBatch | None" = None
                                ) -> tuple[ClusterModel, ClusterModel, LengthDistribution, dict[str, str]]:
    """(PrfaaS-PD model, homogeneous-PD model, lengths, inputs text). Homogeneous PD has the same GPU count,
    all of the PD chip (the paper: 32 H200 + 64 H20 vs 96 H20).

    Instance counts come from ``serving.instances`` (or one per host of the topology), profiles from
    ``serving.profiles``, B_out from ``wan.prfaas_to_pd.rate`` (emulated units), KV bytes from the model's
    spec, lengths from ``workload.input`` (a trace replay: the lengths of the requests it sends within the
    run's duration, `workload_lengths`; `batch`: those requests where the caller has drawn them). Prefix hits are
    ignored: the model sees input lengths as uncached.
    """
    from testbed.serving.config import ServingSpec
    from traffic.workload import WorkloadSpec

    serving = sc.section("serving") or ServingSpec()
    model = sc.section("model")
    workload = sc.section("workload") or WorkloadSpec()
    model_name = model.name if model is not None else "paper-1t-hybrid"
    n_prfaas = serving.count("prfaas_prefill")
    n_prfaas = sc.topology.prfaas.prefill_hosts if n_prfaas is None else n_prfaas
    n_p = serving.count("pd_prefill")
    n_d = serving.count("pd_decode")
    n_pd = (sc.topology.pd.prefill_hosts if n_p is None else n_p) + (sc.topology.pd.decode_hosts if n_d is None else n_d)
    pd_prof = load_profile(_scenario_profile(serving, "pd", model_name))
    kv = spec_kv_bytes(model.spec if model is not None else model_name)
    dist, out_len = workload_lengths(sc, workload, batch)
    cm = ClusterModel(pd_profile=pd_prof, n_pd=n_pd, kv_bytes=kv, output_len=out_len, prfaas_profile=load_profile(_scenario_profile(serving, "prfaas", model_name)),
                      n_prfaas=n_prfaas, egress_bps=sc.wan.prfaas_to_pd.rate_bps, bs_max=serving.bs_max, name=sc.name)
    n_homo = n_pd + round(n_prfaas * cm.prfaas_profile.gpus_per_instance / pd_prof.gpus_per_instance)
    homo = replace(cm, prfaas_profile=None, n_prfaas=0, n_pd=n_homo, name=f"{sc.name} homogeneous PD ({n_homo} instances)")
    inputs = {
        "prfaas": f"{n_prfaas} instances, profile {cm.prfaas_profile.name}",
        "pd": f"{n_pd} instances, profile {pd_prof.name}",
        "egress": f"{sc.wan.prfaas_to_pd.rate_bps / 1e9:g} Gbps (wan.prfaas_to_pd.rate)",
        "model": f"{model_name} (KV bytes from its spec)",
        "lengths": f"{dist.description}; output mean {out_len:g} tokens",
        "decode": f"BS_max {cm.decode_batch} at {cm.decode_step * 1e3:g} ms per step",
        "homogeneous_pd": f"{n_homo} instances of the PD chip (the PrfaaS GPUs replaced by as many PD GPUs)",
        "naive_heterogeneous": f"{n_prfaas} PrfaaS instances prefill everything, {n_pd} PD instances decode",
    }
    return cm, homo, dist, inputs
