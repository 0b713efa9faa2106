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


def test_rtt_is_the_sum_of_both_one_way_delays() -> None:
    sc = parse_scenario({"wan": {"rate": "1Gbps", "delay": "10ms", "pd_to_prfaas": {"delay": "30ms"}}})
    assert sc.wan.rtt_s == pytest.approx(0.040)
