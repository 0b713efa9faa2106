"""Loading a run directory (docs/serving.md "Run directory") into one validated `Run` object.

Every problem is a `UserError` that names the directory, the file and what is wrong, so
``prfaas report`` on a bad directory prints one line instead of a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from analysis.metrics import REQUEST_COLUMNS, summarize
from testbed.errors import UserError

REQUIRED_FILES = ("scenario.yaml", "environment.json", "requests.parquet", "link.parquet", "scheduler.parquet", "summary.json")
SUMMARY_KEYS = ("requests_total", "requests_ok", "requests_failed", "throughput_rps", "ttft_s", "tpot_s",
                "offload_fraction", "egress_gbps", "scale", "policy", "model")
TIME_COLUMNS = ("t_s",)


@dataclass
class Run:
    path: Path
    scenario: dict[str, Any]
    environment: dict[str, Any]
    requests: pd.DataFrame
    link: pd.DataFrame
    scheduler: pd.DataFrame
    summary: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)  # recomputed by analysis.metrics.summarize

    @property
    def name(self) -> str:
        return str(self.summary.get("label") or self.scenario.get("name") or self.path.name)

    @property
    def label(self) -> str:
        """Short label for legends: policy and directory name."""
        pol = self.summary.get("policy") or (self.scenario.get("policy") or {}).get("name", "")
        if pol == "prfaas" and self.signals == "oracle":
            pol += " [ORACLE signals]"
        return f"{pol} ({self.path.name})" if pol else self.path.name

    @property
    def signals(self) -> str:
        """The policy's signal mode; runs recorded before modes existed were told the WAN's capacity (oracle)."""
        return str(self.summary.get("signals") or (self.scenario.get("policy") or {}).get("signals") or "oracle")

    @property
    def schedule_offset_s(self) -> float:
        """Where the scenario's schedule clock (WAN changes, faults) starts on the run's clock."""
        try:
            return float(self.environment.get("workload_start_s") or 0.0)
        except (TypeError, ValueError):
            return 0.0

    @property
    def scale(self) -> float:
        try:
            return float(self.summary.get("scale") or self.scenario.get("scale") or 1.0)
        except (TypeError, ValueError):
            return 1.0


def _read_parquet(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    try:
        df = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise UserError(f"{path}: not a readable parquet file ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise UserError(f"{path}: missing column(s) {', '.join(missing)}; present: {', '.join(map(str, df.columns)) or '(none)'}")
    return df


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: must be a JSON object")
    return data


def load_run(path: str | Path) -> Run:
    """Read and check every file of a run directory; recompute the summary metrics from requests.parquet."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{p}: not a run directory (it does not exist or is not a directory)")
    missing = [f for f in REQUIRED_FILES if not (p / f).is_file()]
    if missing:
        raise UserError(f"{p}: not a complete run directory: missing {', '.join(missing)} (a run writes {', '.join(REQUIRED_FILES)})")
    try:
        scenario = yaml.safe_load((p / "scenario.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{p / 'scenario.yaml'}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(scenario, dict):
        raise UserError(f"{p / 'scenario.yaml'}: must be a mapping")
    environment = _read_json(p / "environment.json")
    summary = _read_json(p / "summary.json")
    absent = [k for k in SUMMARY_KEYS if k not in summary]
    if absent:
        raise UserError(f"{p / 'summary.json'}: missing key(s) {', '.join(absent)}")
    requests = _read_parquet(p / "requests.parquet", REQUEST_COLUMNS)
    link = _read_parquet(p / "link.parquet", TIME_COLUMNS)
    scheduler = _read_parquet(p / "scheduler.parquet", TIME_COLUMNS)
    run = Run(p, scenario, environment, requests, link, scheduler, summary)
    run.metrics = summarize(requests, link, scale=run.scale, policy=str(summary.get("policy", "")),
                            model=str(summary.get("model", "")), duration_s=summary.get("duration_s"), scheduler=scheduler)
    run.metrics["signals"] = run.signals
    return run
