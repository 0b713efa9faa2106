"""Topology builders (two datacenters joined by a WAN) and ready scenario files (*.yaml)."""
