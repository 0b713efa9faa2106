"""Scenario validation (network part) and the units parser: table-driven; every error names its field."""

import pytest

from testbed import units
from testbed.errors import FieldError, UserError
from testbed.scenario import apply_overrides, expand_schedule
from testbed.sections import load_scenario, parse_scenario


def wan(**kw):
    return {"wan": {"rate": "10Gbps", "delay": "10ms", **kw}}


BAD = [
    # (scenario, field named in the error, words of the allowed values)
    (wan(rate="-5Gbps"), "wan.rate", "positive"),
    (wan(rate=100), "wan.rate", "rate unit"),
    (wan(rate="10Gbs"), "wan.rate", "rate unit"),
    (wan(delay="10"), "wan.delay", "time unit"),
    (wan(delay="-1ms"), "wan.delay", "negative"),
    (wan(delay="1000h"), "wan.delay", "longer than 10s"),  # the delay line failed on it with an internal struct error
    (wan(jitter="11s", reorder=True), "wan.jitter", "longer than 10s"),
    (wan(schedule=[{"at": "1s", "delay": "1h"}]), "wan.schedule[0].delay", "longer than 10s"),
    (wan(rate=float("nan")), "wan.rate", "is not a positive number with a unit"),  # YAML's .nan reached the shaper
    (wan(loss="150%"), "wan.loss", "out of range"),
    (wan(loss={"model": "gilbert-elliott", "p": "1%", "r": "0%"}), "wan.loss.r", "bad state"),
    (wan(loss={"model": "bursty"}), "wan.loss.model", "random, gilbert-elliott"),
    (wan(jitter="20ms"), "wan.jitter", "reorder"),
    (wan(jitter_distribution="gauss"), "wan.jitter_distribution", "normal, uniform, pareto"),
    (wan(queue="-3p"), "wan.queue", "positive"),
    (wan(queue="3 apples"), "wan.queue", "bandwidth-delay"),
    (wan(backend="ns3"), "wan.backend", "auto, netem, delayline"),
    (wan(shaper="cake"), "wan.shaper", "htb, tbf"),
    (wan(colour="red"), "wan.colour", "allowed keys"),
    (wan(prfaas_to_pd={"rate": "1Gbps", "speed": 3}), "wan.prfaas_to_pd.speed", "allowed keys"),
    (wan(schedule=[{"at": "30s", "rate": "1Gbps"}, {"at": "10s", "rate": "2Gbps"}]), "wan.schedule[1].at", "time order"),
    (wan(schedule=[{"at": "-1s", "rate": "1Gbps"}]), "wan.schedule[0].at", "negative"),
    (wan(schedule=[{"at": "1s"}]), "wan.schedule[0].at", "at least one of"),
    (wan(schedule=[{"at": "1s", "down": "3s", "for": "2s"}]), "wan.schedule[0].for", "own duration"),
    (wan(schedule=[{"at": "1s", "rate": "fast"}]), "wan.schedule[0].rate", "Gbps"),
    ({**wan(schedule=[{"at": "90s", "rate": "1Gbps"}]), "duration": "60s"}, "wan.schedule", "after the end"),
    ({**wan(), "scale": 0.5}, "scale", ">= 1"),
    ({**wan(), "topology": {"pd": {"decode": 0}}}, "topology.pd.decode", "at least 1"),
    ({**wan(), "topology": {"prfaas": {"decode": 2}}}, "topology.prfaas.decode", "only prefills"),
    ({**wan(), "topology": {"pd": {"prefill": -1}}}, "topology.pd.prefill", "whole number"),
    ({**wan(), "tpology": {}}, "tpology", "allowed keys"),
    ({"topology": {}}, "wan.rate", "required"),
]


@pytest.mark.parametrize("data, field, allowed", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_network_fields_are_refused_naming_field_and_allowed_values(data, field, allowed):
    with pytest.raises(FieldError) as exc:
        parse_scenario(data)
    assert exc.value.field == field
    assert allowed in str(exc.value)


def test_per_direction_values_override_the_common_ones():
    sc = parse_scenario(wan(pd_to_prfaas={"rate": "1Gbps", "delay": "30ms"}))
    assert sc.wan.prfaas_to_pd.rate_bps == 10e9 and sc.wan.prfaas_to_pd.delay_s == 0.01
    assert sc.wan.pd_to_prfaas.rate_bps == 1e9 and sc.wan.pd_to_prfaas.delay_s == 0.03


def test_schedule_expands_for_into_change_and_revert_and_down_into_down_and_up():
    sc = parse_scenario({**wan(schedule=[{"at": "30s", "rate": "20Gbps"}, {"at": "45s", "loss": "2%", "for": "5s"},
                                         {"at": "60s", "down": "3s"}]), "duration": "90s"})
    acts = [(a.at_s, a.kind) for a in expand_schedule(sc.wan.schedule)]
    assert acts == [(30, "change"), (45, "change"), (50, "revert"), (60, "down"), (63, "up")]


def test_overrides_are_read_as_yaml():
    data = apply_overrides({"wan": {"rate": "1Gbps"}}, ["wan.rate=20Gbps", "seed=3"])
    assert data == {"wan": {"rate": "20Gbps"}, "seed": 3}


def test_override_without_equals_is_a_user_error():
    with pytest.raises(UserError, match="key=value"):
        apply_overrides({}, ["wan.rate"])


def test_default_network_scenario_loads():
    sc = load_scenario("net-default")
    assert sc.scale == "auto" and sc.wan.prfaas_to_pd.rate_bps == 100e9 and sc.wan.backend == "auto"


@pytest.mark.parametrize("text, parse, expected", [
    ("100Gbps", units.parse_rate_bps, 100e9),
    ("2.5 Mbit", units.parse_rate_bps, 2.5e6),
    ("10ms", units.parse_duration_s, 0.01),
    ("250us", units.parse_duration_s, 250e-6),
    (0, units.parse_duration_s, 0.0),
    ("0.1%", units.parse_fraction, 0.001),
    (0.25, units.parse_fraction, 0.25),
    ("2MB", units.parse_size_bytes, 2_000_000),
    ("1MiB", units.parse_size_bytes, 1 << 20),
])
def test_units(text, parse, expected):
    assert parse(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, kind, value", [("1bdp", "bdp", 1), ("1000p", "packets", 1000), ("30MB", "bytes", 30e6)])
def test_queue_units(text, kind, value):
    q = units.parse_queue(text)
    assert (q.kind, q.value) == (kind, value)


@pytest.mark.parametrize("make, words", [
    (lambda d: d, "cannot read (Is a directory)"),
    (lambda d: (d / "s.yaml").write_bytes(b"wan: {rate: \xff}\n") and d / "s.yaml", "not UTF-8 text (at byte offset 12)"),
    (lambda d: (d / "s.yaml").write_text("wan:\n  rate: [1,\n") and d / "s.yaml", "not valid YAML at line 3"),
    # a NUL byte: PyYAML's ReaderError has no `problem` and ran over two lines (2026-12-07)
    (lambda d: (d / "s.yaml").write_bytes(b"name: a\x00b\n") and d / "s.yaml",
     "not valid YAML at character 8 (unacceptable character #x0000: special characters are not allowed)"),
])
def test_a_scenario_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(UserError) as err:
        load_scenario(str(path))
    assert str(err.value).startswith(f"{path}: ") and words in str(err.value) and "\n" not in str(err.value)


def test_a_yaml_nan_or_inf_is_not_a_quantity():
    """YAML's .nan and .inf are floats: a NaN arrival rate passed (`prfaas check` printed "offered nan req/s")."""
    for parse in (units.parse_request_rate_rps, units.parse_duration_s, units.parse_rate_bps):
        for bad in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(ValueError, match="is not"):
                parse(bad)
    assert units.parse_request_rate_rps(2) == 2.0 and units.parse_duration_s(0) == 0.0


def test_a_cli_option_is_refused_in_the_words_of_the_scenario_readers() -> None:
    """`validation.option`: one reader per kind of number for CLI options and scenario fields alike; the value is
    named as typed (`0`, `1e400`), not as parsed (`0.0`, `inf`)."""
    import argparse
    import re

    from testbed.validation import at_least_one, option, whole_number, positive_number

    cases = ((positive_number, False, "2.5", 2.5, None), (positive_number, False, "0", None, "0 must be > 0"),
             (positive_number, False, "nan", None, "nan is not a number"), (positive_number, False, "1e400", None, "1e400 is not a number"),
             (positive_number, False, "x", None, "'x' is not a number"), (at_least_one, True, "3", 3, None),
             (at_least_one, True, "0", None, "0 is not a whole number >= 1"), (at_least_one, True, "-2", None, "-2 is not a whole number >= 1"),
             (at_least_one, True, "1.5", None, "'1.5' is not a whole number"), (whole_number, True, "0", 0, None),
             (whole_number, True, "-1", None, "-1 is not a whole number >= 0"))
    for parse, whole, text, value, why in cases:
        read = option(parse, whole=whole)
        if why is None:
            assert read(text) == value and type(read(text)) is type(value)
        else:
            with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(why)}$"):
                read(text)


def test_a_whole_number_past_the_float_range_is_refused_naming_the_field():
    """YAML reads 10**400 as a Python int, which has no float: it was an OverflowError traceback (`--set scale=1000...`)."""
    big = 10**400
    for data, field in ((wan(rate=big), "wan.rate"), ({**wan(), "scale": big}, "scale"), ({**wan(), "duration": big}, "duration")):
        with pytest.raises(FieldError, match="401-digit number is out of range") as exc:
            parse_scenario(data)
        assert exc.value.field == field


@pytest.mark.parametrize("item, words", [
    ("wan.rate=[", "the value is not valid YAML"),  # a YAML error was a traceback
    ("wan.rate=!!python/object:os.system x", "the value is not valid YAML"),
    ("=5", "the key has an empty part"),  # was "scenario: : unknown key"
    ("wan..rate=1Gbps", "the key has an empty part"),
])
def test_a_bad_override_is_one_user_error_naming_it(item, words):
    with pytest.raises(UserError, match=words) as err:
        apply_overrides({"wan": {"rate": "10Gbps"}}, [item])
    assert f"--set {item!r}" in str(err.value)


@pytest.mark.parametrize("item", ["name=\0", "name=a\x01b"])
def test_an_override_with_a_control_character_is_refused_in_one_line(item):
    """PyYAML's ReaderError runs over two lines ("... not allowed" / "in <unicode string>, position 0"): both were
    printed (fuzzing pass 5, 2026-12-08)."""
    with pytest.raises(UserError) as err:
        apply_overrides({"name": "x"}, [item])
    assert "\n" not in str(err.value)
    assert "not valid YAML (unacceptable character #x000" in str(err.value) and "special characters are not allowed)" in str(err.value)


@pytest.mark.parametrize("section, value, field, words", [
    # infinitely many tokens or bytes as a float: `round` raised OverflowError, a traceback in `prfaas check`
    ("policy", {"threshold": "1e308K"}, "policy.threshold", "more than 16M tokens"),
    ("workload", {"output": "1e308M"}, "workload.output", "more than 16M tokens"),
    ("policy", {"kv_state_bytes": "1e308TB"}, "policy.kv_state_bytes", "more than 8EiB"),
    ("wan", {"rate": "1Gbps", "queue": "1e308TB"}, "wan.queue", "more than 4294967295 bytes (4 GiB - 1)"),
    ("wan", {"rate": "1Gbps", "queue": "1e308p"}, "wan.queue", "more than 4294967295 bytes (4 GiB - 1)"),
    # passed as a 307-digit byte count
    ("serving", {"prefix_pool": "1e300MB"}, "serving.prefix_pool", "more than 8EiB"),
])
def test_a_size_or_token_count_past_its_bound_is_refused_not_an_overflow(section, value, field, words):
    with pytest.raises(FieldError) as exc:
        parse_scenario({**wan(), section: value})
    assert exc.value.field == field and words in str(exc.value)
    assert units.parse_size_bytes("8e18B") == 8 * 10**18 and units.MAX_SIZE_BYTES == 2**63 - 1
    with pytest.raises(ValueError, match="more than 8EiB"):
        units.parse_size_bytes("1e19B")


def test_no_name_is_no_scenario():
    """'' is the folder '.': ".: cannot read (Is a directory)"."""
    with pytest.raises(UserError, match="^scenario '': no name; name a scenario file"):
        load_scenario("")


def test_overrides_on_a_file_that_is_not_a_mapping_are_refused_naming_the_file(tmp_path):
    """A list file with --set was an AttributeError traceback ('list' object has no attribute 'setdefault')."""
    path = tmp_path / "s.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(FieldError, match="must be a mapping") as err:
        load_scenario(str(path), ["wan.rate=1Gbps"])
    assert str(err.value).startswith(f"{path}: scenario: ")


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys silently: a second `threshold:` replaced the first unseen."""
    path = tmp_path / "s.yaml"
    path.write_text("wan:\n  rate: 10Gbps\n  delay: 5ms\n  rate: 1Gbps\n")
    with pytest.raises(UserError) as err:
        load_scenario(str(path))
    assert str(err.value) == (f"{path}: not valid YAML at line 4 (key 'rate' is given twice in one mapping "
                              "(first at line 2); keep one)")
    with pytest.raises(UserError, match="given twice"):
        apply_overrides({}, ["wan={rate: 1Gbps, rate: 2Gbps}"])
    from testbed.validation import load_yaml

    assert load_yaml("b: &b {x: 1, y: 2}\nc: {<<: *b, x: 3}\n")["c"] == {"x": 3, "y": 2}


def test_yaml_nested_too_deeply_is_one_line_in_a_file_and_in_a_set_value(tmp_path):
    """A list 3000 deep was a RecursionError traceback wherever YAML is read (a scenario, a spec, --set)."""
    deep = "[" * 3000 + "]" * 3000
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nseed: {deep}\n")
    with pytest.raises(UserError) as err:
        load_scenario(str(path))
    assert str(err.value) == f"{path}: not valid YAML (nested too deeply)"
    with pytest.raises(UserError) as exc:
        apply_overrides({}, [f"seed={deep}"])
    assert str(exc.value).startswith(f"--set 'seed={deep[:55]}'... (6005 characters): "
                                     "the value is not valid YAML (nested too deeply)")  # not echoed whole
    from testbed.validation import load_yaml

    node, depth = load_yaml("[" * 50 + "]" * 50), 1  # a reasonable depth still loads
    while node:
        node, depth = node[0], depth + 1
    assert depth == 50


def test_a_yaml_file_with_no_data_is_refused_naming_what_it_should_hold(tmp_path):
    """`validation.read_yaml`, every user YAML file's reader: an empty file (or only comments, or null) was an empty
    mapping, each reader's defaults: `prfaas check empty.yaml --set wan.rate=10Gbps` checked the default scenario, an
    empty run directory's scenario.yaml read as {}, an empty spec was 'scenario: is required' (2026-12-07)."""
    from experiments.spec import load_spec
    from testbed.models.spec import load_model_spec

    path = tmp_path / "s.yaml"
    for content, what in (("", "empty"), ("\n  \n", "empty"), ("# name: x\n", "no data (only comments, or null)"),
                          ("~\n", "no data (only comments, or null)")):
        path.write_text(content)
        with pytest.raises(UserError) as err:
            load_scenario(str(path), ["wan.rate=10Gbps"])
        assert str(err.value) == f"{path}: {what}; a scenario (a YAML mapping of name, wan, workload, ...: docs/scenario.md) is expected"
    path.write_text("")
    with pytest.raises(UserError, match=r": empty; an experiment spec \(a YAML mapping of scenario, arms"):
        load_spec(path)
    with pytest.raises(UserError, match=r": empty; a model spec \(a YAML mapping of name, layers"):
        load_model_spec(str(path))
    path.write_text("{}\n")  # an empty mapping is given on purpose: a section's defaults
    with pytest.raises(FieldError, match="wan.rate: is required"):
        load_scenario(str(path))


def test_a_whole_number_past_4300_digits_is_one_line_in_a_file_and_in_a_set_value(tmp_path):
    """Python reads no whole number past 4300 digits: `seed: 1000...` was a ValueError traceback wherever YAML is read."""
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nseed: 1" + "0" * 5000 + "\n")
    with pytest.raises(UserError) as err:
        load_scenario(str(path))
    assert str(err.value) == f"{path}: not valid YAML at line 2 (a whole number of 5001 characters, more than the 4300 digits Python reads)"
    with pytest.raises(UserError, match="the value is not valid YAML \\(a whole number of 5001 characters"):
        apply_overrides({}, ["seed=1" + "0" * 5000])
    from testbed.validation import load_yaml

    assert load_yaml("a: 1_000\nb: 0x1f\nc: 1:30\nd: 1" + "0" * 4000) == {"a": 1000, "b": 31, "c": 90, "d": 10**4000}


@pytest.mark.parametrize("value", [{}, "", 0, False])
def test_an_empty_non_list_is_not_an_empty_list(value):
    """`wan.schedule: {}` (or '', 0) passed as no schedule: `Fields.items` took anything falsy for []."""
    with pytest.raises(FieldError, match="must be a list") as exc:
        parse_scenario(wan(schedule=value))
    assert exc.value.field == "wan.schedule"
    assert parse_scenario(wan(schedule=None)).wan.schedule == ()


@pytest.mark.parametrize("key, value", [
    ("model", {"name": "x" * 300}),  # Path.exists raised OSError (ENAMETOOLONG): a traceback
    ("model", {"name": "x" * 300 + ".yaml"}),
    ("model", {"name": "a\0b"}),  # ValueError: embedded null byte
    ("serving", {"profiles": {"pd": "x" * 300 + ".yaml"}}),
    ("workload", {"trace": {"path": "x" * 300}}),
])
def test_a_name_no_file_can_have_is_no_such_file(key, value):
    with pytest.raises(FieldError) as exc:
        parse_scenario({**wan(), key: value}, "topologies/quick.yaml")
    assert exc.value.field.startswith(key + ".")
    with pytest.raises(UserError, match="no such file"):
        load_scenario("x" * 300)


@pytest.mark.parametrize("section, value, field", [
    ("workload", {"input": "1e30"}, "workload.input"),  # numpy's OverflowError: a traceback
    ("workload", {"input": {"dist": "uniform", "min": 1, "max": 10**30}}, "workload.input.max"),  # 'high is out of bounds'
    ("policy", {"threshold": "1e30"}, "policy.threshold"),  # passed
    ("policy", {"max_threshold": "17M"}, "policy.max_threshold"),
])
def test_a_token_count_past_16M_is_refused_naming_the_field(section, value, field):
    with pytest.raises(FieldError, match="more than 16M tokens") as exc:
        parse_scenario({**wan(), section: value})
    assert exc.value.field == field
    assert units.parse_tokens("16M") == units.MAX_TOKENS


@pytest.mark.parametrize("data, field, words", [
    ({**wan(), "duration": "1e30s"}, "duration", "longer than a week"),  # "valid" until the workload refused it at run time
    ({**wan(), "serving": {"slo": {"ttft": "1e30s"}}}, "serving.slo.ttft", "longer than a week"),
    (wan(rate="1e30Gbps"), "wan.rate", "more than 1000Tbps"),  # passed: a BDP of 1e26 GiB
    ({**wan(), "topology": {"lan_rate": "2000Tbps"}}, "topology.lan_rate", "more than 1000Tbps"),
])
def test_a_duration_past_a_week_or_a_rate_past_1000Tbps_is_refused(data, field, words):
    with pytest.raises(FieldError, match=words) as exc:
        parse_scenario(data)
    assert exc.value.field == field
    assert units.parse_duration_s("168h") == units.MAX_DURATION_S and units.parse_rate_bps("1000Tbps") == units.MAX_RATE_BPS


X = {"prfaas": {"cross": 1}, "pd": {"cross": 1}}  # a cross-traffic host in each datacenter


def flow(**kw):
    return {**wan(), "duration": "30s", "topology": X, "cross_traffic": {"flows": [{"protocol": "tcp", **kw}]}}


# Fuzzing pass 4 (2026-12-07): each was taken by the reader and `prfaas check` (or hung it), and did nonsense in a run
FUZZ4 = [
    # a flow that never started, an entry that never fired: wan.schedule refuses the like
    (flow(start="1h"), "cross_traffic.flows[0].start", "3600s is not before the end of the run (duration 30s)"),
    (flow(pattern="schedule", schedule=[{"at": "0s", "rate": "1Gbps"}, {"at": "1h", "rate": "2Gbps"}]),
     "cross_traffic.flows[0].schedule[1].at", "3600s is after the end of the run (duration 30s)"),
    # 15 million iperf3 pairs planned; `prfaas check` took 22 s to count them (1ns: hours)
    (flow(pattern="onoff", on="1us", off="1us"), "cross_traffic.flows[0].on", "start more than 10,000 periods in the run (30s)"),
    # every iperf3 exited at once: "invalid report interval (min = 0.1, max = 60 seconds)"
    ({**flow(), "cross_traffic": {"interval": "61s"}}, "cross_traffic.interval", "longer than 60s, the longest report interval iperf3 takes"),
    # a network namespace each (the bound of 64 hosts left cross-traffic hosts out)
    ({**wan(), "topology": {"pd": {"cross": 10**9}}}, "topology.pd.cross", "1000000000 is more than 64 hosts, as many as worker hosts"),
    # tc's byte limit is 32-bit (a run's tc refused it); 1e300bdp was an OverflowError traceback in prfaas check
    (wan(queue="1e300MB"), "wan.queue", "'1e300MB' is more than 4294967295 bytes (4 GiB - 1), the most a queue's byte limit holds"),
    (wan(queue="3000000p"), "wan.queue", "'3000000p' is more than 4294967295 bytes"),
    (wan(queue="1e300bdp"), "wan.queue", "'1e300bdp' is more than 1000bdp"),
]


@pytest.mark.parametrize("data, field, words", FUZZ4)
def test_fuzzing_pass_4_refusals_name_the_field(data, field, words):
    with pytest.raises(FieldError) as exc:
        parse_scenario(data)
    assert exc.value.field == field and words in str(exc.value)


def test_a_udp_on_off_flow_without_stop_is_checked_in_its_runs_periods():
    """Its periods are endless: `prfaas check` listed them all (memory exhausted, never returned). Checked on the run's
    30 s: on 0-5 s, 10-15 s, 20-25 s, so half the run at 1 Gbps, nothing in an off period, and the UDP peak warned of."""
    from analysis.scenario_check import check_scenario, cross_traffic_bps

    sc = parse_scenario(flow(protocol="udp", rate="1Gbps", pattern="onoff", on="5s", off="5s"))
    assert cross_traffic_bps(sc, 0, 30) == pytest.approx(0.5e9) and cross_traffic_bps(sc, 5, 10) == 0
    assert any(w.startswith("cross_traffic: the UDP flows send 86 thousand datagrams/s") for w in check_scenario(sc).warnings)
    from analysis.scenario_check import udp_datagrams_per_s_peak

    assert udp_datagrams_per_s_peak(sc, 1) == pytest.approx(1e9 / (1448 * 8))
    assert parse_scenario(flow(pattern="onoff", on="1ms", off="2ms")).section("cross_traffic").flows[0].on_s == 0.001  # 10,000 fit


@pytest.mark.parametrize("data, field, words", [
    ({**wan(), "name": "../../x"}, "name", "not a plain name"),  # the run directory runs/<name>-<time> went two levels up
    ({**wan(), "name": [1, 2]}, "name", "not a non-empty string"),  # ran as "[1, 2]"
    ({**wan(), "name": ""}, "name", "not a non-empty string"),
    ({**wan(), "model": {"name": "paper-1t-hybrid", "profile": [1]}}, "model.profile", "not a non-empty string"),
    ({**wan(), "cross_traffic": {"flows": [{"name": {"a": 1}}]}}, "cross_traffic.flows[0].name", "not a non-empty string"),
])
def test_names_are_plain_strings(data, field, words):
    with pytest.raises(FieldError, match=words) as exc:
        parse_scenario(data)
    assert exc.value.field == field
    assert parse_scenario({**wan(), "name": 2026}).name == "2026"


def test_a_name_that_goes_into_a_file_or_directory_name_is_at_most_200_bytes():
    """`name: <300 characters>` passed `prfaas check`, then `prfaas run` died on OSError "File name too long": the
    run directory runs/<name>-YYYYmmdd-HHMMSS adds 16 bytes to the 255 a directory name may have. A flow's name
    names its iperf3 logs, <name>.<period>.server.json, the same way (`validation.MAX_NAME_BYTES`)."""
    assert parse_scenario({**wan(), "name": "a" * 200}).name == "a" * 200
    for name, size in (("a" * 201, 201), ("é" * 101, 202)):  # bytes of UTF-8, not characters
        with pytest.raises(FieldError) as exc:
            parse_scenario({**wan(), "name": name})
        assert str(exc.value) == (f"name: {name[:24]!r}... is {size} bytes long; a name is at most 200 bytes (it names the run's "
                                  "directory runs/<name>-<time>, and a file or directory name is at most 255)")
    with pytest.raises(FieldError) as exc:
        parse_scenario({**wan(), "name": "a\ud800"})  # YAML's "\ud800": mkdir raised UnicodeEncodeError
    assert str(exc.value) == "name: 'a\\ud800' is not valid Unicode text (a lone surrogate); it names the run's directory runs/<name>-<time>"
    flows = {"flows": [{"name": "../x", "protocol": "tcp"}]}  # its logs went to ../x.0.server.json
    with pytest.raises(FieldError) as exc:
        parse_scenario({**wan(), "cross_traffic": flows})
    assert str(exc.value) == ("cross_traffic.flows[0].name: '../x' is not a plain name (it names its iperf3 logs "
                              "<name>.<period>.server.json); use letters, digits, '-', '_' or '.', without '/'")
    with pytest.raises(FieldError, match=r"^cross_traffic.flows\[0\].name: 'aaaaaaaaaaaaaaaaaaaaaaaa'... is 201 bytes long"):
        parse_scenario({**wan(), "cross_traffic": {"flows": [{"name": "a" * 201, "protocol": "tcp"}]}})


def test_a_scenario_without_a_name_is_named_by_its_file_only_where_that_can_be_a_name(tmp_path):
    """Without `name:` the file's name (its stem) named the run's directory unchecked: a 250-byte file name passed
    `prfaas check` and runs/<name>-<time> was too long; a file name that is not UTF-8 passed as a lone surrogate."""
    from testbed.sections import load_scenario

    ok = tmp_path / "my-wan.yaml"
    ok.write_text("wan: {rate: 10Gbps}\n")
    assert load_scenario(str(ok)).name == "my-wan"
    long = tmp_path / ("a" * 250 + ".yaml")
    long.write_text("wan: {rate: 10Gbps}\n")
    with pytest.raises(FieldError) as exc:
        load_scenario(str(long))
    assert (exc.value.field, str(exc.value)) == ("name", f"{long}: name: not given, and the file's name cannot stand for it: "
                                                 "'aaaaaaaaaaaaaaaaaaaaaaaa'... is 250 bytes long; a name is at most 200 bytes (it names the "
                                                 "run's directory runs/<name>-<time>, and a file or directory name is at most 255); add "
                                                 "name: <a plain name> to the file")
    assert load_scenario(str(long), ["name=short"]).name == "short"  # named: the file's name does not matter
    odd = tmp_path / "b\udcff.yaml"  # a file name byte 0xff (not UTF-8), as Python reads it
    odd.write_text("wan: {rate: 10Gbps}\n")
    with pytest.raises(FieldError) as exc:
        load_scenario(str(odd))
    assert str(exc.value).endswith("name: not given, and the file's name cannot stand for it: 'b\\udcff' is not valid Unicode text "
                                   "(a lone surrogate); it names the run's directory runs/<name>-<time>; add name: <a plain name> "
                                   "to the file")


def test_a_seed_is_a_whole_number_from_0_to_2_to_the_32_minus_1_wherever_it_is_read():
    """`seed: 10**400` passed (whole_number) and failed a torch run's workers (torch.manual_seed takes < 2**64); one
    reader, `validation.random_seed`, for the scenario's, the workload's and the model's seed (docs/scenario.md)."""
    assert parse_scenario({**wan(), "seed": 2**32 - 1}).seed == 2**32 - 1 and parse_scenario({**wan(), "seed": 0}).seed == 0
    for data, field, shown in (({**wan(), "seed": 10**400}, "seed", "a 401-digit number"), ({**wan(), "seed": 2**32}, "seed", "4294967296"),
                               ({**wan(), "seed": -1}, "seed", "-1"), ({**wan(), "seed": 1.5}, "seed", "1.5"),
                               ({**wan(), "workload": {"seed": 2**64}}, "workload.seed", "18446744073709551616"),
                               ({**wan(), "model": {"name": "paper-1t-hybrid", "seed": 2**64}}, "model.seed", "18446744073709551616")):
        with pytest.raises(FieldError) as exc:
            parse_scenario(data)
        assert str(exc.value) == f"{field}: {shown} is not a seed; use a whole number from 0 to 4294967295 (2**32 - 1)"


def test_a_cross_traffic_flow_on_a_host_the_topology_lacks_is_refused():
    """`prfaas check` passed it; the run failed once its network was up (quick.yaml has topology.prfaas.cross: 0)."""
    topo = {"prfaas": {"prefill": 1, "cross": 0}, "pd": {"prefill": 1, "decode": 1, "cross": 1}}
    with pytest.raises(FieldError, match="prfaas-x0 is not a host of the topology: topology.prfaas.cross is 0; raise it$") as exc:
        parse_scenario({**wan(), "topology": topo, "cross_traffic": {"flows": [{"protocol": "tcp"}]}})
    assert exc.value.field == "cross_traffic.flows[0].src"
    with pytest.raises(FieldError, match="raise it or use pd-x0") as exc:
        parse_scenario({**wan(), "topology": topo, "cross_traffic": {"flows": [{"direction": "pd_to_prfaas", "src": "pd-x2", "dst": "prfaas-x0"}]}})
    assert exc.value.field == "cross_traffic.flows[0].src"


@pytest.mark.parametrize("schedule, words", [
    # the second dip's revert restored the first dip's rate: the line stayed at 1Gbps for good
    ([{"at": "10s", "rate": "1Gbps", "for": "10s"}, {"at": "15s", "rate": "2Gbps", "for": "10s"}], "has its rate changed by entry 0 until 20s"),
    ([{"at": "10s", "rate": "1Gbps", "for": "10s"}, {"at": "12s", "rate": "3Gbps"}], "has its rate changed by entry 0 until 20s"),
    ([{"at": "10s", "down": "10s"}, {"at": "12s", "down": "2s"}], "is down by entry 0 until 20s"),
])
def test_an_entry_inside_an_earlier_window_on_the_same_field_is_refused(schedule, words):
    with pytest.raises(FieldError, match=words) as exc:
        parse_scenario(wan(schedule=schedule))
    assert exc.value.field == "wan.schedule[1].at"


def test_windows_on_other_fields_directions_or_back_to_back_are_allowed():
    for schedule in ([{"at": "10s", "rate": "1Gbps", "for": "10s"}, {"at": "20s", "rate": "2Gbps", "for": "5s"}],
                     [{"at": "10s", "rate": "1Gbps", "for": "10s"}, {"at": "12s", "loss": "1%", "for": "20s"}],
                     [{"at": "10s", "rate": "1Gbps", "for": "10s", "direction": "prfaas_to_pd"},
                      {"at": "12s", "rate": "2Gbps", "direction": "pd_to_prfaas"}],
                     [{"at": "10s", "down": "10s"}, {"at": "12s", "rate": "2Gbps"}]):
        assert len(parse_scenario(wan(schedule=schedule)).wan.schedule) == 2


@pytest.mark.parametrize("schedule, message", [
    # the later entry won, unsaid (2026-12-07)
    ([{"at": "5s", "delay": "20ms"}, {"at": "10s", "rate": "1Gbps"}, {"at": "10s", "rate": "2Gbps"}],
     "wan.schedule[2].rate: at 10s sets prfaas_to_pd's rate again (also set by wan.schedule[1])"),
    ([{"at": "10s", "rate": "1Gbps"}, {"at": "10s", "delay": "20ms"}, {"at": "10s", "rate": "2Gbps", "direction": "pd_to_prfaas"}],
     "wan.schedule[2].rate: at 10s sets pd_to_prfaas's rate again (also set by wan.schedule[0])"),
    ([{"at": "10s", "loss": "1%", "for": "5s"}, {"at": "10s", "loss": "2%"}], "wan.schedule[1].loss: at 10s sets prfaas_to_pd's loss again"),
    ([{"at": "10s", "down": "1s"}, {"at": "10s", "down": "2s"}], "wan.schedule[1].down: at 10s takes prfaas_to_pd down again"),
])
def test_two_entries_at_one_time_changing_one_field_of_one_direction_are_refused_naming_both(schedule, message):
    with pytest.raises(FieldError) as exc:
        parse_scenario(wan(schedule=schedule))
    assert str(exc.value).startswith(message)


def test_entries_at_one_time_changing_other_fields_or_directions_are_allowed():
    for schedule in ([{"at": "10s", "rate": "1Gbps"}, {"at": "10s", "delay": "20ms"}, {"at": "10s", "loss": "1%", "for": "5s"}],
                     [{"at": "10s", "rate": "1Gbps", "direction": "prfaas_to_pd"}, {"at": "10s", "rate": "2Gbps", "direction": "pd_to_prfaas"}],
                     [{"at": "10s", "rate": "1Gbps", "for": "5s"}, {"at": "15s", "rate": "2Gbps"}]):  # a revert, then a change
        assert len(parse_scenario(wan(schedule=schedule)).wan.schedule) == len(schedule)


@pytest.mark.parametrize("schedule, field", [
    ([{"at": "1s", "jitter": "100ms"}], "wan.schedule[0].jitter"),  # passed on a 10 ms line (the base values are refused)
    ([{"at": "1s", "delay": "1ms", "for": "5s"}, {"at": "2s", "jitter": "5ms"}], "wan.schedule[1].jitter"),
    ([{"at": "1s", "delay": "50ms", "for": "5s"}, {"at": "2s", "jitter": "20ms"}], "wan.schedule[0].for"),  # the revert to 10 ms
])
def test_scheduled_jitter_larger_than_the_delay_is_refused_with_in_order_delivery(schedule, field):
    with pytest.raises(FieldError, match="with in-order delivery jitter must be <= delay") as exc:
        parse_scenario(wan(schedule=schedule))
    assert exc.value.field == field
    assert parse_scenario(wan(schedule=schedule, reorder=True)).wan.schedule
    assert parse_scenario(wan(schedule=[{"at": "1s", "delay": "50ms", "jitter": "20ms", "for": "5s"}])).wan.schedule


def test_the_jitter_check_walks_the_timeline_a_run_fires():
    """At one instant an entry's revert fires before a later entry's change (`expand_schedule`): jitter 8 ms on the
    10 ms line until 10 s, then the delay down to 5 ms at 10 s is never 8 ms of jitter on 5 ms of delay. The check
    walked all changes before all reverts and refused it (until 2026-12-07)."""
    schedule = [{"at": "5s", "jitter": "8ms", "for": "5s"}, {"at": "10s", "delay": "5ms"}]
    kinds = [(a.at_s, a.kind) for a in expand_schedule(parse_scenario(wan(schedule=schedule)).wan.schedule)]
    assert kinds == [(5.0, "change"), (10.0, "revert"), (10.0, "change")]
    with pytest.raises(FieldError, match="with in-order delivery jitter must be <= delay") as exc:  # a second later, it is
        parse_scenario(wan(schedule=[{"at": "5s", "jitter": "8ms", "for": "6s"}, {"at": "10s", "delay": "5ms"}]))
    assert exc.value.field == "wan.schedule[1].delay"


def test_a_negative_quantity_is_said_to_be_negative_before_its_missing_unit():
    """A bare -1 was "has no rate/time/size unit", and the same value with a unit then refused as negative: two tries for
    one mistake (2026-12-07)."""
    import re

    for parse, words in ((units.parse_rate_bps, "must be positive"), (units.parse_duration_s, "must not be negative"),
                         (units.parse_size_bytes, "must not be negative")):
        for bad in (-1, "-1", -0.5):
            with pytest.raises(ValueError, match=f"^{re.escape(repr(bad))} {words}; use a "):
                parse(bad)


def test_a_number_yaml_read_as_text_is_refused_saying_how_to_write_it(tmp_path):
    """YAML 1.1 reads a number with an exponent only with a '.' and a sign: `scale: 1e3` is the text '1e3', which was
    "'1e3' is not a number" (2026-12-07)."""
    path = tmp_path / "s.yaml"
    path.write_text("wan: {rate: 10Gbps, delay: 10ms}\nscale: 1e3\n")
    with pytest.raises(FieldError, match=r"scale: '1e3' is text, not a number .*write 1\.0e\+3\)"):
        load_scenario(str(path))
    path.write_text("wan: {rate: 10Gbps, delay: 10ms}\nscale: 1.0e+3\n")
    assert load_scenario(str(path)).scale == 1000.0


def test_schedule_step_reverts_to_what_its_change_found():
    """The one definition of the schedule's state (`schedule_step`): a change records what it replaces, its revert
    restores that (here the 2 Gbps an earlier change without `for` set), and a down or up sets no spec."""
    from testbed.scenario import DIRECTIONS, expand_schedule, schedule_step

    sc = parse_scenario({**wan(), "wan": {**wan()["wan"], "schedule": [
        {"at": "5s", "rate": "2Gbps", "direction": "prfaas_to_pd"}, {"at": "10s", "rate": "1Gbps", "delay": "20ms", "for": "5s"},
        {"at": "20s", "down": "1s"}]}})
    current, saved, seen = {d: sc.wan.direction(d) for d in DIRECTIONS}, {}, []
    for a in expand_schedule(sc.wan.schedule):
        current.update(step := schedule_step(current, saved, a))
        seen.append((a.at_s, a.kind, sorted(step), current["prfaas_to_pd"].rate_bps, current["prfaas_to_pd"].delay_s))
    base_delay = sc.wan.prfaas_to_pd.delay_s
    both = sorted(DIRECTIONS)
    assert seen == [(5.0, "change", ["prfaas_to_pd"], 2e9, base_delay), (10.0, "change", both, 1e9, 0.02),
                    (15.0, "revert", both, 2e9, base_delay), (20.0, "down", [], 2e9, base_delay),
                    (21.0, "up", [], 2e9, base_delay)]
    assert current["pd_to_prfaas"] == sc.wan.pd_to_prfaas
    assert saved == {(0, "prfaas_to_pd"): {"rate_bps": 10e9}}  # a change without `for` is never reverted


def test_an_unknown_top_level_key_lists_every_section_and_names_the_near_one():
    """A typo of a section (`worklaod:`) was refused with "allowed keys here: duration, name, scale, seed, topology, wan":
    the sections a scenario did not have were missing from the list (2026-12-07). They are listed now, and a key close to
    an allowed one is named."""
    from testbed.sections import SCENARIO_KEYS

    with pytest.raises(FieldError) as exc:
        parse_scenario({"wan": {"rate": "10Gbps"}, "worklaod": {"arrivals": {"rate": 1}}})
    assert exc.value.field == "worklaod"
    listed = str(exc.value).split("allowed keys here: ")[1].split(", ")
    assert set(listed) == SCENARIO_KEYS and "workload" in listed and "did you mean 'workload'?" in str(exc.value)
    with pytest.raises(FieldError) as exc:
        parse_scenario({"wan": {"rate": "10Gbps", "zzz": 1}})
    assert "did you mean" not in str(exc.value) and exc.value.field == "wan.zzz"


def test_too_many_worker_hosts_in_a_datacenter_says_the_counts_it_summed():
    with pytest.raises(FieldError) as exc:
        parse_scenario({"wan": {"rate": "10Gbps"}, "topology": {"pd": {"prefill": 60, "decode": 5}}})
    assert exc.value.field == "topology.pd" and "prefill 60 + decode 5 worker hosts; at most 64 per datacenter" in str(exc.value)
    with pytest.raises(FieldError) as exc:  # "at most 64 worker hosts per datacenter" named neither count
        parse_scenario({"wan": {"rate": "10Gbps"}, "topology": {"pd": {"prefill": 10**30}}})
    assert "prefill a 31-digit number + decode 1" in str(exc.value)
