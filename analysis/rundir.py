"""A run directory for analysis: `testbed.rundir.load_run_dir` (the one loader, which checks every file)
plus the summary metrics recomputed by `analysis.metrics.summarize`.

Every problem is a `UserError` that names the directory, the file and what is wrong, so
``prfaas report`` on a bad directory prints one line instead of a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from analysis.metrics import summarize
from testbed.rundir import RunData, load_run_dir


@dataclass
class Run(RunData):
    """A loaded run directory (`RunData`) with its summary metrics recomputed by `analysis.metrics.summarize`."""

    metrics: dict[str, Any] = field(default_factory=dict)

    def section(self, key: str) -> dict[str, Any]:
        """A section of the run's scenario.yaml as a plain mapping ({} when it is absent or not a mapping)."""
        v = self.scenario.get(key)
        return v if isinstance(v, dict) else {}

    def parsed_scenario(self) -> Any:
        """The run's scenario.yaml read by the scenario reader, errors naming the file."""
        from testbed.rundir import SCENARIO_FILE
        from testbed.sections import parse_scenario

        return parse_scenario(self.scenario, str(self.path / SCENARIO_FILE))

    @property
    def name(self) -> str:
        return str(self.summary.get("label") or self.scenario.get("name") or self.path.name)

    @property
    def label(self) -> str:
        """Short label for legends: policy and directory name."""
        pol = self.summary.get("policy") or self.section("policy").get("name", "")
        if pol == "prfaas" and self.signals == "oracle":
            pol += " [ORACLE signals]"
        return f"{pol} ({self.path.name})" if pol else self.path.name

    @property
    def signals(self) -> str:
        """The policy's signal mode; runs recorded before modes existed were told the WAN's capacity (oracle)."""
        return str(self.summary.get("signals") or self.section("policy").get("signals") or "oracle")

    @property
    def schedule_offset_s(self) -> float:
        """Where the scenario's schedule clock (WAN changes, faults) starts on the run's clock."""
        try:
            return float(self.environment.workload_start_s or 0.0)
        except (TypeError, ValueError):
            return 0.0

    @property
    def scale(self) -> float:
        try:
            return float(self.environment.scale or 1.0)
        except (TypeError, ValueError):
            return 1.0


def load_run(path: str | Path) -> Run:
    """Read and check every file of a run directory; recompute the summary metrics from requests.parquet."""
    data = load_run_dir(path)
    assert data.summary is not None
    run = Run(**vars(data))
    run.metrics = summarize(data.requests, data.link, scale=run.scale, policy=str(data.summary.get("policy", "")),
                            model=str(data.summary.get("model", "")), duration_s=data.summary.get("duration_s"),
                            scheduler=data.scheduler, compute=data.environment.compute.get("mode"),
                            hybrid=data.environment.compute.get("hybrid"))
    run.metrics["signals"] = run.signals
    return run
