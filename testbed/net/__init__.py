"""Network emulation: the two-datacenter topology on Mininet, WAN shaping (HTB/TBF + netem or the
userspace delay line), the schedule of WAN changes, telemetry, calibration and cleanup."""
