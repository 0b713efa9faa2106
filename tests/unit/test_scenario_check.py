"""`prfaas check`: derived figures of a scenario, and one line + exit 2 for every refused mutation."""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import pytest
import yaml

from analysis.scenario_check import check_scenario
from testbed import cli
from testbed.errors import UserError
from testbed.scenario import builtin_scenarios_dir
from testbed.sections import load_scenario, parse_scenario

READY = sorted(p.stem for p in builtin_scenarios_dir().glob("*.yaml"))


@pytest.mark.parametrize("name", READY)
def test_every_ready_scenario_checks_with_exit_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.process_time()
    assert cli.main(["check", name]) == 0
    assert time.process_time() - t0 < 1.0  # CPU time: the wall clock of a loaded host says little
    out = capsys.readouterr().out
    assert f"scenario {name}" in out and "valid" in out


def test_wire_rate_bdp_and_queue_follow_rate_scale_and_delay() -> None:
    sc = parse_scenario({"name": "x", "scale": 10, "wan": {"rate": "5Gbps", "delay": "5ms", "queue": "4bdp"}})
    d = check_scenario(sc).directions[0]
    assert d.wire_rate_bps == pytest.approx(500e6)
    assert d.rtt_s == pytest.approx(0.010)
    assert d.bdp_wire_bytes == pytest.approx(500e6 / 8 * 0.010, rel=1e-6)  # 625,000 B
    assert d.queue_wire_bytes == pytest.approx(4 * 625_000, rel=0.01)


def test_offered_kv_load_against_capacity_before_and_during_the_dip() -> None:
    rep = check_scenario(load_scenario("quick"))
    before, dip, after = rep.segments
    assert (dip.start_s, dip.end_s) == (12.0, 20.0)
    assert before.capacity_bps == 5e9 and dip.capacity_bps == 1e9 and after.capacity_bps == 5e9
    # the same offered load meets a 5x smaller link
    assert dip.utilisation == pytest.approx(5 * before.utilisation)
    assert rep.offered_kv_bps == pytest.approx(before.utilisation * 5e9)
    assert 0 < rep.offload_fraction < 1
    assert rep.model["lambda_max_at_t_star_rps"] >= rep.model["lambda_max_at_base_t_rps"] > 0


def test_a_trace_replay_is_checked_on_the_requests_it_sends(test_data: Path, tmp_path: Path) -> None:
    """Replaying a trace, the offered rate, the offload share and the KV come from the trace's requests
    within the run's duration (they read 0 req/s and the default input distribution before 2026-12-05)."""
    import numpy as np

    from analysis.throughput_model import cluster_model_from_scenario
    from traffic.trace import read_trace

    path = test_data / "mooncake_conversation_trace_60s.jsonl"
    for duration_s in (30, 60):
        sc = load_scenario("quick", [f"workload={{trace: {{path: {path}}}}}", f"duration={duration_s}s"])
        sent = [r for r in read_trace(path).requests if r.arrival_s < duration_s]
        rep = check_scenario(sc)
        assert rep.arrival_rate_rps == pytest.approx(len(sent) / duration_s)
        long_ = [r.input_len for r in sent if r.input_len > 6144]  # quick's base threshold: 6K
        assert rep.offload_fraction == pytest.approx(len(long_) / len(sent))
        cm, _, dist, inputs = cluster_model_from_scenario(sc)
        assert dist.mean == pytest.approx(np.mean([r.input_len for r in sent]))
        assert cm.output_len == pytest.approx(np.mean([r.output_len for r in sent]))
        assert "mooncake_conversation_trace_60s.jsonl" in inputs["lengths"]
    faster = load_scenario("quick", [f"workload={{trace: {{path: {path}, time_scale: 0.5}}}}"])  # 30 s: its first minute
    assert check_scenario(faster).arrival_rate_rps == pytest.approx(162 / 30)
    # new arrival times at 10/s: the trace's 162 requests run out after ~16 s of the 60
    poisson = load_scenario("quick", [f"workload={{trace: {{path: {path}}}, arrivals: {{process: poisson, rate: 10/s}}}}",
                                      "duration=60s"])
    assert check_scenario(poisson).arrival_rate_rps == pytest.approx(162 / 60)
    late = tmp_path / "late.jsonl"
    late.write_text('{"timestamp": 5000, "input_length": 9000, "output_length": 10, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]}\n')
    with pytest.raises(UserError, match=r"workload.trace: .*late.jsonl: its first request arrives at 5 s, not before the end of the run \(duration 1 s\)"):
        load_scenario("quick", [f"workload={{trace: {{path: {late}}}}}", "duration=1s", "wan.schedule=[]"])  # the workload's check


def test_a_trace_replay_is_drawn_once_for_the_arrival_rate_and_the_model(test_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prfaas check` drew the trace's requests within the run twice (the arrival rate, then the model's lengths);
    once now, handed to both, with the same figures as the model drawing its own."""
    from analysis.throughput_model import at_threshold, cluster_model_from_scenario
    from traffic import workload
    from traffic.trace import read_trace

    path = test_data / "mooncake_conversation_trace_60s.jsonl"
    sc = load_scenario("quick", [f"workload={{trace: {{path: {path}}}}}"])  # 30 s of it
    drawn, generate_batch = [], workload.generate_batch
    monkeypatch.setattr(workload, "generate_batch", lambda *a: drawn.append(a) or generate_batch(*a))
    rep = check_scenario(sc)
    assert len(drawn) == 1
    assert rep.arrival_rate_rps == pytest.approx(sum(r.arrival_s < 30 for r in read_trace(path).requests) / 30) == pytest.approx(2.9)
    cm, _, dist, _ = cluster_model_from_scenario(sc)  # drawing its own
    assert len(drawn) == 2
    assert rep.model["lambda_max_at_base_t_rps"] == pytest.approx(at_threshold(cm, dist, 6144.0).lambda_max)
    p, _, _ = dist.split([6144.0], cm.kv_bytes(dist.lengths))
    assert rep.offload_fraction == pytest.approx(float(p[0]))


def test_cross_traffic_is_taken_from_the_capacity_left_for_kv() -> None:
    rep = check_scenario(load_scenario("case-study"))
    dip = rep.segments[1]
    assert dip.cross_bps == pytest.approx(16e9)
    assert dip.utilisation == pytest.approx(rep.offered_kv_bps / (20e9 - 16e9))


def test_warnings_for_scenarios_that_cannot_show_anything() -> None:
    rep = check_scenario(load_scenario("quick", ["wan.schedule=[{at: 12s, rate: 1Gbps, for: 4ms}]", "workload.arrivals.rate=0.01/s"]))
    text = " ".join(rep.warnings)
    assert "shorter than the RTT" in text and "never binds" in text
    rep = check_scenario(load_scenario("quick", ["scale=1", "wan.rate=50Gbps"]))
    assert any("more than this host's capacity" in w for w in rep.warnings)
    assert not check_scenario(load_scenario("quick")).warnings


def test_a_torch_run_with_another_models_profiles_warns_that_the_model_lines_are_that_models() -> None:
    """Its Lambda_max lines came from the paper's 1T-hybrid profiles for a kimi-linear-48b run without a word (a
    profile-mode scenario of them is refused since 2026-12-07; a torch run does not use them)."""
    rep = check_scenario(load_scenario("torch-quick", ["model.name=kimi-linear-48b", "serving.profiles.pd=h20-minimax-m2.5"]))
    assert rep.model is not None
    assert rep.warnings == [
        "the model lines (Lambda_max, t*) use profile 'h200-paper-1t-hybrid' of model 'paper-1t-hybrid' (serving.profiles.prfaas) "
        "and profile 'h20-minimax-m2.5' of model 'minimax-m2.5' (serving.profiles.pd), while the run computes model "
        "'kimi-linear-48b' on torch: another model's times at this model's KV bytes (name profiles of 'kimi-linear-48b' for "
        "this run's figures)"]
    assert not check_scenario(load_scenario("torch-quick")).warnings  # its own model's profiles


def test_a_trace_with_lines_skip_bad_skipped_is_a_warning_naming_the_count_and_the_first_reason(tmp_path: Path) -> None:
    """Only `prfaas traffic stats` said how many lines skip_bad skipped; `prfaas check` said nothing (2026-12-07)."""
    good = "".join(f'{{"timestamp": {t}, "input_length": 600, "output_length": 8, "hash_ids": [{t}, {t + 1}]}}\n' for t in (1000, 2000, 3000))
    trace = tmp_path / "t.jsonl"
    trace.write_text(good + '{"timestamp": 4000}\nnot json\n')
    rep = check_scenario(load_scenario("quick", [f"workload={{trace: {{path: {trace}, skip_bad: true}}}}"]))
    assert (f"workload.trace: skip_bad skipped 2 bad line(s) of {trace}, the first: line 4, field 'input_length': is missing; "
            "3 request(s) kept (prfaas traffic stats --skip-bad FILE lists the reasons)") in rep.warnings
    trace.write_text(good)
    rep = check_scenario(load_scenario("quick", [f"workload={{trace: {{path: {trace}, skip_bad: true}}}}"]))
    assert not any("skip_bad" in w for w in rep.warnings)
    # without skip_bad, the refusal says how a scenario skips them: its field, not `prfaas traffic stats`' option
    trace.write_text(good + "not json\n")
    with pytest.raises(UserError, match=r"line 4.*\(set workload.trace.skip_bad: true to skip and count bad lines\)$"):
        load_scenario("quick", [f"workload={{trace: {{path: {trace}}}}}"])


# ----------------------------------------------------------------------------------------- fuzz corpus

BAD_VALUES = ["abc", -1, 0, None, [], {}, [1, 2], {"x": 1}, True, 1e308, "10 furlongs", "-5ms", "1e99Gbps", "0%", "150%", "nan"]


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _set(data: dict, path: tuple, value: object, delete: bool = False) -> None:
    node = data
    for p in path[:-1]:
        node = node[p]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def mutations(count_per_scenario: int = 60, seed: int = 13) -> list[tuple[str, dict]]:
    """Deterministic mutations of the ready scenarios: a value replaced by a wrong one, a key deleted,
    an unknown key added, a section replaced by a scalar."""
    rng = random.Random(seed)
    out = []
    for name in READY:
        base = yaml.safe_load((builtin_scenarios_dir() / f"{name}.yaml").read_text())
        paths = _paths(base)
        for i in range(count_per_scenario):
            data = copy.deepcopy(base)
            path = rng.choice(paths)
            kind = i % 4
            if kind == 0:
                _set(data, path, rng.choice(BAD_VALUES))
            elif kind == 1 and not isinstance(path[-1], int):
                _set(data, path, None, delete=True)
            elif kind == 2:
                parent = data
                for p in path[:-1]:
                    parent = parent[p]
                if isinstance(parent, dict):
                    parent[f"unknown_{i}"] = 1
                else:
                    _set(data, path, "junk")
            else:
                _set(data, path, rng.choice(["1Gbps", "2s", 3, "4K", "bogus", -0.5]))
            out.append((f"{name}-{i}:{'.'.join(map(str, path))}", data))
    return out


def test_fuzz_corpus_refusals_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = mutations()
    assert len(corpus) >= 200
    refused = 0
    for label, data in corpus:
        f = tmp_path / "s.yaml"
        f.write_text(yaml.safe_dump(data))
        status = cli.main(["check", str(f)])  # any exception but UserError propagates and fails the test
        out, err = capsys.readouterr()
        assert status in (0, 2), label
        if status == 2:
            refused += 1
            assert err.count("\n") == 1 and err.startswith("prfaas check: error: "), (label, err)
        else:
            assert "valid" in out, label
    assert refused >= 100  # most mutations are bad input; the rest must check cleanly


@pytest.mark.parametrize("sets, heading", [
    ([], "PrfaaS->PD capacity left by cross traffic (no serving sections: no offered KV load):"),
    (["workload.arrivals={process: closed, users: 4, think: 1s}"],
     "  PrfaaS->PD capacity left by cross traffic (a closed-loop workload has no fixed rate: no offered KV load):")])
def test_the_capacity_without_an_offered_load_has_its_own_heading(sets: list[str], heading: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A network-only scenario (lab 1's, net-default) or a closed loop printed its capacity lines under no heading, each
    with an empty "offered/left -" (2026-12-07)."""
    name = "net-default" if not sets else "quick"
    assert cli.main(["check", name, *[a for s in sets for a in ("--set", s)]]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = lines.index(heading)
    capacities = [ln for ln in lines if " s  capacity " in ln]
    assert lines[i + 1:i + 1 + len(capacities)] == capacities and len(capacities) == (1 if not sets else 3)
    assert "100 Gbps  (base)" in capacities[0] if not sets else "1 Gbps  (change prfaas_to_pd rate 1 Gbps)" in capacities[1]
    assert not [ln for ln in lines if "offered/left" in ln]


@pytest.mark.parametrize("name", READY)
def test_json_output_is_strict_json(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli.main(["check", name, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert doc["name"] and len(doc["directions"]) == 2 and doc["segments"]


def test_udp_neighbours_beyond_what_the_host_keeps_on_time_are_warned_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """val-cross-surge at scale 50 needs ~97 thousand datagrams/s at its surge, which a 2-core host did not keep on time
    (docs/kv.md, session 56); at scale 100 (48 thousand) and the case study (27.6 thousand) the neighbours kept their rate.
    (What else such a host holds beside them, the router's own time included, is judged after the run: the case study at
    scale 50 keeps its neighbour's rate on 2 cores but starves its router, docs/scale-out.md, "The router's own time".)"""
    from analysis import scenario_check

    monkeypatch.setattr(scenario_check.os, "cpu_count", lambda: 2)
    assert scenario_check.udp_datagrams_per_s_peak(load_scenario("val-cross-surge"), 50) == pytest.approx(56e9 / 50 / (1448 * 8))
    assert scenario_check.udp_datagrams_per_s_peak(load_scenario("case-study"), 50) == pytest.approx(27.6e3, rel=0.01)
    warned = [w for w in check_scenario(load_scenario("val-cross-surge")).warnings if w.startswith("cross_traffic:")]
    assert len(warned) == 1 and "97 thousand datagrams/s" in warned[0] and "2 core(s)" in warned[0] and "raise scale" in warned[0]
    for name, sets in (("val-cross-surge", ["scale=100"]), ("case-study", [])):
        assert not [w for w in check_scenario(load_scenario(name, sets)).warnings if w.startswith("cross_traffic:")], name
    monkeypatch.setattr(scenario_check.os, "cpu_count", lambda: 4)  # twice the cores: the same scenario fits
    assert not [w for w in check_scenario(load_scenario("val-cross-surge")).warnings if w.startswith("cross_traffic:")]


def test_the_capacity_after_a_revert_is_what_its_change_found_not_the_base_rate() -> None:
    """A revert restores the values its entry's change found (`testbed.scenario.schedule_step`, as a run's WAN does):
    after 1 Gbps for 5 s on a line set to 2 Gbps at 5 s, the line is back at 2 Gbps; `prfaas check` drew the base
    5 Gbps (2026-12-07)."""
    from analysis.scenario_check import capacity_segments

    sc = load_scenario("quick", ["wan.schedule=[{at: 5s, rate: 2Gbps}, {at: 10s, rate: 1Gbps, for: 5s}, {at: 20s, down: 2s}]"])
    assert [(t, end, r) for t, end, r, _ in capacity_segments(sc)] == [
        (0.0, 5.0, 5e9), (5.0, 10.0, 2e9), (10.0, 15.0, 1e9), (15.0, 20.0, 2e9), (20.0, 22.0, 0.0), (22.0, 30.0, 2e9)]


def test_a_schedule_step_to_a_queue_past_tcs_byte_limit_is_refused_naming_the_step() -> None:
    """A BDP-sized queue is re-sized at every delay or rate change; `prfaas check` planned only the base state, so a
    2-s delay under 100bdp (23 GiB on the wire) passed and failed when the run applied it (2026-12-07)."""
    with pytest.raises(UserError, match=r"^wan.queue: 23.28 GiB on the wire .* \(at 5s of wan.schedule: change "
                                        r"prfaas_to_pd\+pd_to_prfaas delay 2 s, prfaas_to_pd\)$"):
        check_scenario(load_scenario("quick", ["wan.queue=100bdp", "wan.schedule=[{at: 5s, delay: 2s, for: 5s}]"]))
    assert check_scenario(load_scenario("quick", ["wan.queue=100bdp", "wan.schedule=[{at: 5s, delay: 200ms, for: 5s}]"]))
