"""Offloads go off only where netem would otherwise lose GSO super-packets: the netem backend with any loss
in the WAN, at the start or later in its schedule (testbed/net/offloads.py)."""

import subprocess

import pytest

from testbed.errors import HostError
from testbed.net.offloads import decide_offloads, ethtool_argv, turn_off
from testbed.sections import load_scenario, parse_scenario


def wan(**spec):
    return parse_scenario({"name": "u-offloads", "duration": "60s", "wan": {"rate": "1Gbps", "delay": "5ms", **spec}}).wan


def test_a_loss_free_wan_keeps_offloads_on_with_netem() -> None:
    d = decide_offloads(wan(), "netem")
    assert d.on and d.describe() == "on (no loss in the WAN or its schedule)"


def test_random_loss_in_one_direction_turns_them_off_with_netem_only() -> None:
    lossy = wan(prfaas_to_pd={"loss": "0.1%"})
    assert decide_offloads(lossy, "netem").describe() == "off (loss per wire packet)"
    assert decide_offloads(lossy, "delayline").describe() == "on (delayline: it loses per wire packet itself)"


def test_a_gilbert_elliott_burst_later_in_the_schedule_turns_them_off_from_the_start() -> None:
    sc = load_scenario("topologies/val-loss-burst.yaml")  # loss-free until a GE burst at 25 s
    assert all(sc.wan.direction(d).loss.mean_rate == 0 for d in ("prfaas_to_pd", "pd_to_prfaas"))
    assert not decide_offloads(sc.wan, "netem").on


def test_a_schedule_that_only_sets_loss_to_zero_or_changes_the_rate_keeps_them_on() -> None:
    w = wan(schedule=[{"at": "10s", "loss": "0%"}, {"at": "20s", "rate": "100Mbps", "for": "5s"},
                      {"at": "30s", "loss": {"model": "gilbert-elliott", "p": "0%", "r": "30%"}}])
    assert decide_offloads(w, "netem").on


def test_ethtool_argv_names_every_feature_that_builds_super_packets() -> None:
    assert ethtool_argv("prfaas-gw-wan", False) == ["ethtool", "-K", "prfaas-gw-wan", "tso", "off", "gso", "off", "gro", "off"]


def _sh(script: str):
    return lambda argv: subprocess.Popen(["sh", "-c", script, "sh", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_turn_off_runs_one_ethtool_per_interface_in_its_namespace() -> None:
    seen = []
    ok = _sh('exit 0')
    record = lambda argv: seen.append(argv) or ok(argv)  # noqa: E731
    assert turn_off([(record, "h1-eth0"), (record, "prfaas-gw-lan")]) == 2
    assert [a[2] for a in seen] == ["h1-eth0", "prfaas-gw-lan"]


def test_a_refused_interface_stops_the_start_with_its_name_and_the_reason() -> None:
    refuse = _sh('echo "Cannot change tcp-segmentation-offload" >&2; exit 1')
    with pytest.raises(HostError, match=r"netem would lose whole GSO super-packets.*pd-d0-eth0: exit 1: Cannot change"):
        turn_off([(_sh("exit 0"), "prfaas-p0-eth0"), (refuse, "pd-d0-eth0")])
