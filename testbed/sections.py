"""Every scenario section beyond the network, with the package that owns it; whole scenarios are read here.

`SECTIONS` is the one table: a new section is a line here naming its owner's parser (and, if it has
one, its check across sections, and the rates `scale` divides onto the wire). `load_scenario` / `parse_scenario` read a whole scenario with it;
`testbed.scenario` (the network schema, `Scenario`) stays below the packages that own sections.
"""

from __future__ import annotations

from typing import Any

from testbed.models.spec import parse_model_section
from testbed.scenario import NETWORK_KEYS, Scenario, Section, read_scenario, read_scenario_file
from testbed.serving.config import check_scenario, parse_serving_section
from testbed.serving.policy import parse_policy_section
from traffic.cross import check_cross_traffic, cross_traffic_rates, parse_cross_traffic_section
from traffic.workload import check_workload, parse_workload_section

SECTIONS: tuple[Section, ...] = (
    Section("model", parse_model_section),
    Section("workload", parse_workload_section, check=check_workload),
    Section("policy", parse_policy_section),
    Section("serving", parse_serving_section, check=check_scenario),
    Section("cross_traffic", parse_cross_traffic_section, check=check_cross_traffic, rates=cross_traffic_rates),
)


SCENARIO_KEYS = frozenset({*NETWORK_KEYS, *(s.key for s in SECTIONS)})  # every top-level key a whole scenario may have


def parse_scenario(data: Any, source: str | None = None) -> Scenario:
    """A whole scenario from its YAML data (`source`: the file it came from, named in errors)."""
    return read_scenario(data, source, sections=SECTIONS)


def load_scenario(name_or_path: str, overrides: list[str] | None = None) -> Scenario:
    """A whole scenario from a file or a ready scenario's name, with ``--set key=value`` overrides."""
    return read_scenario_file(name_or_path, overrides, sections=SECTIONS)
