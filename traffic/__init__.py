"""Workloads: length distributions, arrival processes, sessions with shared prefixes, trace replay, WAN cross-traffic."""
