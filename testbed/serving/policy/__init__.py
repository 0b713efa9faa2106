"""Scheduling policies of the router: where each request is prefilled, and how the threshold t moves.

One small interface (`Policy`, in `base`): `decide(request, state) -> Decision` on every arrival,
`on_telemetry` for measurements and `tick(now_s)` for the control loop. Modules by concept:

- `spec`: the scenario's ``policy:`` section (`PolicySpec`, `parse_policy_section`);
- `base`: what a policy sees and returns, the interface, instance choice;
- `baselines`: fixed-threshold, oracle-step (its clairvoyant step), homogeneous-pd, all-local, naive-heterogeneous;
- `controller`: the PrfaaS controller (the control law of t and what it measures);
- `prfaas`: the `prfaas` policy (length routing + the controller + role flips);
- `log`: the `SchedulerLog` (-> scheduler.parquet).

Policies are registered by name in `POLICIES`; `build_policy` makes the one a spec names.
"""

from __future__ import annotations

from typing import Sequence

from testbed.serving.policy.base import (
    ClusterState, Decision, InstanceState, NoInstanceError, Policy, RequestView, TelemetrySample,
)
from testbed.serving.policy.baselines import (
    AllLocalPolicy, HomogeneousPDPolicy, NaiveHeterogeneousPolicy, OracleStepPolicy, ThresholdPolicy,
)
from testbed.serving.policy.controller import PrfaasController
from testbed.serving.policy.log import SchedulerLog
from testbed.serving.policy.prfaas import PrfaasPolicy
from testbed.serving.policy.spec import (
    MAX_TOKENS, POLICY_NAMES, SIGNAL_MODES, ControlSpec, PolicySpec, RoleFlipSpec, parse_policy_section,
)

__all__ = [
    "AllLocalPolicy", "ClusterState", "ControlSpec", "Decision", "HomogeneousPDPolicy", "InstanceState", "MAX_TOKENS",
    "NaiveHeterogeneousPolicy", "NoInstanceError", "OracleStepPolicy", "POLICIES", "POLICY_NAMES", "Policy", "SIGNAL_MODES", "PolicySpec", "PrfaasController",
    "PrfaasPolicy", "RequestView", "RoleFlipSpec", "SchedulerLog", "TelemetrySample", "ThresholdPolicy", "build_policy",
    "parse_policy_section",
]

POLICIES: dict[str, type[Policy]] = {
    "prfaas": PrfaasPolicy,
    "fixed-threshold": ThresholdPolicy,
    "homogeneous-pd": HomogeneousPDPolicy,
    "naive-heterogeneous": NaiveHeterogeneousPolicy,
    "all-local": AllLocalPolicy,
    "oracle-step": OracleStepPolicy,
}
assert set(POLICIES) == set(POLICY_NAMES)


def build_policy(
    spec: PolicySpec,
    prefill: Sequence[InstanceState],
    decode: Sequence[InstanceState],
    log: SchedulerLog | None = None,
    capacity_bps: float = 0.0,
    standby: Sequence[tuple[str, int]] = (),
    compressed_kv_ratio: float = 0.5,
) -> Policy:
    """The registered policy of `spec.name`; `compressed_kv_ratio`: float8's bytes per element over the model's KV
    dtype's (what `policy.kv_compression` saves on a token's full-attention KV)."""
    return POLICIES[spec.name](spec, prefill, decode, log=log, capacity_bps=capacity_bps, standby=standby,
                               compressed_kv_ratio=compressed_kv_ratio)
