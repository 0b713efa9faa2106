"""Analysis: loading run directories, metrics, the PrfaaS throughput model, plots and reports."""
