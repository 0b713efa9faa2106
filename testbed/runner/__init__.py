"""The runner: one complete run of a scenario, as raw results in a run directory (`testbed.rundir`).

Modules, one concept each:

- `run`: `run_scenario`, the sequence network up -> processes -> workload -> collect -> down;
- `supervisor`: starting, watching and stopping the run's processes in their hosts;
- `configs`: the configuration files handed to the workers, the router and the client agent;
- `relay`: WAN telemetry from NET to the router (through the client agent's stdin);
- `live`: the live view (state fed by the client agent, the rich progress table);
- `faults`: the scenario's fault injections, timed from the workload's start;
- `collect`: the raw run directory from the processes' records.

The runner sits above the serving plane and below the experiments layer; it never imports `analysis`
(summaries are computed by ``experiments.runs``).
"""
