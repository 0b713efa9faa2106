"""Scale: the one wire <-> emulated conversion, and the one RTT."""

import numpy as np
import pytest

from testbed.errors import FieldError
from testbed.scale import Scale
from testbed.sections import parse_scenario


def test_conversions_go_both_ways() -> None:
    s = Scale(20)
    assert s.wire_bps(100e9) == 5e9 and s.emulated_bps(5e9) == 100e9
    assert s.wire_bytes(2_000) == 100 and s.emulated_bytes(100) == 2_000
    assert np.array_equal(s.emulated_bps(np.array([1.0, 2.0])), np.array([20.0, 40.0]))
    assert float(s) == 20.0 and str(Scale(2.5)) == "2.5"


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("nan"), float("inf"), True, "2"])
def test_scale_below_one_or_not_a_number_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        Scale(bad)  # type: ignore[arg-type]


def test_of_accepts_a_factor_or_a_scale() -> None:
    s = Scale(4)
    assert Scale.of(s) is s and Scale.of(4) == s and Scale.of(4.0).factor == 4.0


def test_scenario_scale_is_checked_by_scale_and_names_the_field() -> None:
    with pytest.raises(FieldError, match=r"^scale: 0.5 must be a number >= 1 .* or 'auto'"):
        parse_scenario({"wan": {"rate": "1Gbps"}, "scale": 0.5})
    sc = parse_scenario({"wan": {"rate": "100Gbps"}, "scale": "auto"})
    assert sc.resolve_scale(5e9) == Scale(20)
    assert sc.with_scale(Scale(20)).raw["scale"] == 20.0


def test_a_scale_that_puts_a_rate_below_the_lowest_wire_rate_is_refused_naming_scale_and_the_rate() -> None:
    """`scale: 1e30` ran a 100 Gbps WAN at 1e-19 bit/s (the shaper failed to install below 3.8 Kbps); the floor is
    `units.MIN_WIRE_RATE_BPS`, 8 Kbps, for every rate the scale divides (docs/scenario.md, "Top level")."""
    tail = "below 8 Kbps, the lowest rate the wire can be shaped at; use a scale of at most"
    for extra, says in (
            ({"scale": 1e30}, f"scale: 1e+30 puts the prfaas_to_pd WAN rate, 100 Gbps, at 1e-19 bps on the wire, {tail} 12500000 "
                              "(that rate / 8 Kbps)"),
            ({"scale": 12500001}, f"scale: 12500001 puts the prfaas_to_pd WAN rate, 100 Gbps, at 7999.99936 bps on the wire, {tail} "
                                  "12500000 (that rate / 8 Kbps)"),
            ({"scale": 200, "wan": {"rate": "100Gbps", "pd_to_prfaas": {"rate": "1Mbps"}}},
             f"scale: 200 puts the pd_to_prfaas WAN rate, 1 Mbps, at 5000 bps on the wire, {tail} 125 (that rate / 8 Kbps)"),
            ({"scale": 200, "wan": {"rate": "100Gbps", "schedule": [{"at": "1s", "rate": "1Mbps", "for": "1s"}]}},
             f"scale: 200 puts wan.schedule[0].rate, 1 Mbps, at 5000 bps on the wire, {tail} 125 (that rate / 8 Kbps)"),
            ({"scale": 200, "topology": {"lan_rate": "1Mbps"}},
             f"scale: 200 puts topology.lan_rate, 1 Mbps, at 5000 bps on the wire, {tail} 125 (that rate / 8 Kbps)"),
            ({"scale": 200, "cross_traffic": {"flows": [{"protocol": "udp", "rate": "1Mbps"}]}},
             f"scale: 200 puts cross_traffic.flows[0].rate, 1 Mbps, at 5000 bps on the wire, {tail} 125 (that rate / 8 Kbps)"),
            ({"scale": 200, "cross_traffic": {"flows": [{"pattern": "schedule", "schedule": [{"at": "0s", "rate": "1Gbps"},
                                                                                             {"at": "1s", "rate": "1Mbps"}]}]}},
             f"scale: 200 puts cross_traffic.flows[0].schedule[1].rate, 1 Mbps, at 5000 bps on the wire, {tail} 125 (that rate / 8 Kbps)")):
        with pytest.raises(FieldError) as err:
            parse_scenario({"wan": {"rate": "100Gbps"}, **extra})
        assert (err.value.field, str(err.value)) == ("scale", says)
    assert parse_scenario({"wan": {"rate": "100Gbps"}, "scale": 12500000}).resolve_scale(0.0) == Scale(12500000)
    with pytest.raises(FieldError) as err:
        parse_scenario({"wan": {"rate": "7Kbps"}})  # no scale >= 1 lifts it: the rate itself is refused
    assert str(err.value) == "wan.rate: '7Kbps' is less than 8Kbps, the lowest rate the wire can be shaped at; use 8Kbps or more"


def test_scale_auto_still_resolves_and_is_refused_only_where_it_puts_a_rate_below_the_lowest_wire_rate() -> None:
    sc = parse_scenario({"wan": {"rate": "100Gbps", "schedule": [{"at": "1s", "rate": "160Kbps", "for": "1s"}]}, "scale": "auto"})
    assert sc.resolve_scale(5e9) == Scale(20)  # 160 Kbps / 20 = 8 Kbps: just allowed
    with pytest.raises(FieldError) as err:
        sc.resolve_scale(1e9)
    assert (err.value.field, str(err.value)) == ("scale", "scale: auto (here 100, for a host capacity of 1 Gbps) puts wan.schedule[0].rate, "
                                                 "160 Kbps, at 1600 bps on the wire, below 8 Kbps, the lowest rate the wire can be shaped at; "
                                                 "use a scale of at most 20 (that rate / 8 Kbps), or raise that rate to 800 Kbps or more")


def test_the_wire_rates_are_checked_at_one_call_site_for_a_numeric_scale_and_auto_alike(monkeypatch) -> None:
    """`check_wire_rates` was called with a numeric scale in two places (`read_scenario` and `resolve_scale`), each
    building the scale and its wording itself; `resolve_scale` is now the one call, and the reader resolves a numeric
    scale through it. A scenario whose scale is set after it was read (`with_scale`) is still checked when resolved."""
    import ast
    import inspect

    from testbed import scenario as scenario_module
    from testbed.scenario import Scenario

    calls = [n for n in ast.walk(ast.parse(inspect.getsource(scenario_module)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "check_wire_rates"]
    assert len(calls) == 1
    said: list[tuple[float, str, bool]] = []
    check = Scenario.check_wire_rates
    monkeypatch.setattr(Scenario, "check_wire_rates", lambda self, scale, s, auto=False: (said.append((scale.factor, s, auto)),
                                                                                          check(self, scale, s, auto))[1])
    sc = parse_scenario({"wan": {"rate": "100Gbps"}, "scale": 20})
    assert said == [(20.0, "20", False)] and sc.resolve_scale(1e9) == Scale(20)
    assert parse_scenario({"wan": {"rate": "100Gbps"}, "scale": "auto"}).resolve_scale(1e9) == Scale(100)
    assert said[1:] == [(20.0, "20", False), (100.0, "auto (here 100, for a host capacity of 1 Gbps)", True)]
    with pytest.raises(FieldError, match=r"^scale: 1e\+30 puts the prfaas_to_pd WAN rate, 100 Gbps, at 1e-19 bps on the wire"):
        sc.with_scale(1e30).resolve_scale(1e9)


def test_rtt_is_the_sum_of_both_one_way_delays() -> None:
    sc = parse_scenario({"wan": {"rate": "1Gbps", "delay": "10ms", "pd_to_prfaas": {"delay": "30ms"}}})
    assert sc.wan.rtt_s == pytest.approx(0.040)


@pytest.mark.parametrize("value", ["fast", "nan", "-1", "1", "1e30", "5GB"])
def test_the_host_capacity_variable_is_a_rate_and_anything_else_one_line_naming_it(monkeypatch, value: str) -> None:
    """PRFAAS_CAPACITY_BPS was read with float(): 'fast' was a ValueError traceback in prfaas check, 'nan' passed. The
    refusal quotes the value as set (the rate reader's quoted '-1bps') and says what the variable takes."""
    from testbed.errors import UserError
    from testbed.net.emulation import host_capacity_bps

    monkeypatch.setenv("PRFAAS_CAPACITY_BPS", value)
    with pytest.raises(UserError) as err:
        host_capacity_bps()
    assert str(err.value) == (f"PRFAAS_CAPACITY_BPS={value!r} is not this host's WAN capacity: give bits per second (e.g. 5e9) "
                              "or a rate with its unit (e.g. 5Gbps), from 8 Kbps to 1000 Tbps; unset, 5 Gbps")


def test_the_host_capacity_variable_is_bits_per_second_or_a_rate_with_its_unit(monkeypatch) -> None:
    from testbed.net.emulation import host_capacity_bps

    for value in ("5e9", "2500000000.0", " 5Gbps "):  # as experiments.parallel writes it: repr of a float
        monkeypatch.setenv("PRFAAS_CAPACITY_BPS", value)
        assert host_capacity_bps() == (float(value.strip().replace("Gbps", "e9")), "PRFAAS_CAPACITY_BPS")
    monkeypatch.delenv("PRFAAS_CAPACITY_BPS")
    assert host_capacity_bps() == (5e9, "default (5 Gbps)")
