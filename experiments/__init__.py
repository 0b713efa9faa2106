"""The experiments layer: runs of the testbed turned into summarised, comparable results.

It sits above the runner (`testbed.runner`) and analysis (`analysis`) and below the CLI:

- `runs`: one run -> its run directory with ``summary.json`` (`run_once`, `summarize_run_dir`, `execute`);
- `executor`: the executor interface every way of running many runs goes through (`Executor`,
  `RunTask`, `RunOutcome`, `make_executor`);
- `sweep`: ``prfaas sweep``, a grid of scenario variations;
- `commands`: ``prfaas run``, ``quickstart``, ``sweep``.
"""
