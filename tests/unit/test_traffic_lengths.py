"""Length distributions: sample statistics against closed forms, and the scenario form."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.errors import FieldError
from traffic.lengths import PAPER_INPUT, Empirical, Fixed, Mixture, TruncatedLogNormal, Uniform, parse_length


def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


def test_paper_lognormal_matches_the_papers_mean_and_offload_share() -> None:
    x = PAPER_INPUT.sample(rng(), 400_000)
    assert x.min() >= 128 and x.max() <= 128 * 1024
    assert abs(x.mean() - 27_500) / 27_500 < 0.01  # the target's 27.5K is 27,500 tokens (closed form: 27,486)
    assert abs(x.mean() - PAPER_INPUT.mean()) / PAPER_INPUT.mean() < 0.005
    assert abs((x > 19_400).mean() - 0.496) < 0.005
    assert abs(PAPER_INPUT.survival(19_400) - 0.4957) < 0.0005


def test_lognormal_closed_form_mean_is_the_numerical_integral() -> None:
    from scipy import integrate, stats

    d = TruncatedLogNormal(9.0, 0.7, 1000, 20_000)
    ln = stats.lognorm(0.7, scale=np.exp(9.0))
    z = ln.cdf(20_000) - ln.cdf(1000)
    ref = integrate.quad(lambda v: v * ln.pdf(v), 1000, 20_000)[0] / z
    assert d.mean() == pytest.approx(ref, rel=1e-6)


def test_fixed_uniform_empirical_and_mixture_statistics() -> None:
    assert (Fixed(1024).sample(rng(), 10) == 1024).all()
    u = Uniform(100, 200).sample(rng(), 200_000)
    assert u.min() == 100 and u.max() == 200
    assert u.mean() == pytest.approx(150, abs=0.3)
    e = Empirical((10, 20, 30, 40)).sample(rng(), 100_000)
    assert set(np.unique(e)) == {10, 20, 30, 40}
    assert e.mean() == pytest.approx(25, abs=0.2)
    m = Mixture((0.25, 0.75), (Fixed(1000), Fixed(3000)))
    s = m.sample(rng(), 100_000)
    assert (s == 1000).mean() == pytest.approx(0.25, abs=0.01)
    assert m.mean() == 2500


def test_same_seed_same_lengths() -> None:
    a = PAPER_INPUT.sample(np.random.default_rng(7), 1000)
    b = PAPER_INPUT.sample(np.random.default_rng(7), 1000)
    assert (a == b).all()


def test_parse_scalar_mapping_and_mixture() -> None:
    assert parse_length("32K", "workload.input") == Fixed(32768)
    assert parse_length({"dist": "lognormal", "mu": 9.9, "sigma": 1.0, "min": 128, "max": "128K"}, "w.input") == PAPER_INPUT
    m = parse_length({"dist": "mixture", "components": [{"weight": 1, "dist": "fixed", "tokens": 10},
                                                        {"weight": 3, "dist": "uniform", "min": 1, "max": 5}]}, "w.input")
    assert isinstance(m, Mixture) and m.weights == (0.25, 0.75)


@pytest.mark.parametrize("value, field, words", [
    ({"dist": "gamma"}, "w.input.dist", "lognormal"),
    ({"dist": "uniform", "min": 10, "max": 5}, "w.input.max", "below min"),
    ({"dist": "lognormal", "mu": 9.9, "sigma": -1}, "w.input.sigma", "> 0"),
    ({"dist": "fixed", "tokens": 5, "extra": 1}, "w.input.extra", "unknown key"),
    ("lots", "w.input", "tokens"),
    ({"dist": "mixture", "components": [{"weight": -1, "dist": "fixed", "tokens": 1}]}, "w.input.components[0].weight", ">= 0"),
])
def test_bad_length_specs_name_the_field(value, field, words) -> None:
    with pytest.raises(FieldError) as e:
        parse_length(value, "w.input")
    assert e.value.field == field
    assert words in str(e.value)


def test_empirical_from_trace(mooncake_trace) -> None:
    d = parse_length({"dist": "empirical", "trace": str(mooncake_trace), "field": "output_length"}, "w.output")
    assert isinstance(d, Empirical) and len(d.values) == 3993
    assert d.mean() == pytest.approx(149.12, abs=0.01)


@pytest.mark.parametrize("value, field, words", [
    ({"dist": "lognormal", "mu": 1e30, "sigma": 1.0}, "w.input.mu", "exp(mu) = inf"),  # math.exp overflowed: a traceback
    ({"dist": "mixture", "components": [{"weight": 1e308, "dist": "fixed", "tokens": 5},
                                        {"weight": 1e308, "dist": "fixed", "tokens": 6}]},
     "w.input.components", "add up to inf"),  # numpy's draw failed on NaN shares: a traceback
    ({"dist": "empirical", "trace": "/nonexistent.jsonl"}, "w.input.trace", "cannot open"),  # the error named no field
])
def test_lengths_out_of_reach_are_refused_naming_the_field(value, field, words):
    with pytest.raises(FieldError) as exc:
        parse_length(value, "w.input")
    assert exc.value.field == field and words in str(exc.value)
