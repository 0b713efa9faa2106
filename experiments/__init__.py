"""The experiments layer: runs of the testbed turned into summarised, comparable results.

It sits above the runner (`testbed.runner`) and analysis (`analysis`) and below the CLI:

- `runs`: one run -> its run directory with ``summary.json`` (`run_once`, `summarize_run_dir`, `execute`);
- `executor`: the executor interface every way of running many runs goes through (`Executor`,
  `RunTask`, `RunOutcome`, `make_executor`);
- `engine`: runs the tasks not finished yet through an executor (resumable), for every command below;
- `sweep`: ``prfaas sweep``, a grid of scenario variations;
- `spec`, `experiment`: ``prfaas experiment``, arms x seeds x repetitions with paired comparisons;
- `capacity`: ``prfaas capacity``, Lambda_max measured by bracketing and bisection;
- `reproduce`: ``prfaas reproduce case-study``;
- `commands`: the CLI of all of the above, plus ``prfaas run`` and ``quickstart``.
"""
