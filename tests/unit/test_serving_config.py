"""The scenario's serving section and the run plan: bad input is refused before anything starts,
with one error that names the field; good input is placed on the topology's hosts."""

from __future__ import annotations

import pytest

from testbed.cli import main as cli_main
from testbed.errors import FieldError, UserError
from testbed.models.spec import load_model_spec
from testbed.sections import load_scenario
from testbed.serving.compute import wire_layer_bytes
from testbed.serving.config import DECODE_PORT, KV_PORT, PREFILL_PORT, plan_run


def plan(*overrides: str):
    return plan_run(load_scenario("quick", list(overrides)))


def refused(*overrides: str) -> FieldError:
    with pytest.raises(UserError) as info:
        plan(*overrides)
    return info.value


def test_quick_scenario_places_prfaas_prefill_first_then_pd_prefill_then_decode():
    p = plan()
    assert p.compute == "profile"
    assert [(i.role, i.index, i.cluster, i.host, i.port) for i in p.instances] == [
        ("prefill", 0, "prfaas", "prfaas-p0", PREFILL_PORT),
        ("prefill", 1, "prfaas", "prfaas-p0", PREFILL_PORT + 1),
        ("prefill", 2, "pd", "pd-p0", PREFILL_PORT + 2),
        ("prefill", 3, "pd", "pd-p0", PREFILL_PORT + 3),
        ("decode", 0, "pd", "pd-d0", DECODE_PORT),
        ("decode", 1, "pd", "pd-d0", DECODE_PORT + 1),
    ]
    assert [i.kv_port for i in p.instances if i.role == "decode"] == [KV_PORT, KV_PORT + 1]
    assert dict(p.profiles) == {"prfaas": "h200-paper-1t-hybrid", "pd": "h20-paper-1t-hybrid"}


def test_instances_spread_round_robin_over_hosts_and_default_to_one_per_host():
    p = plan("topology.pd.decode=3", "serving.instances.pd_decode=5", "serving.instances.pd_prefill=null")
    assert [i.host for i in p.instances if i.role == "decode"] == ["pd-d0", "pd-d1", "pd-d2", "pd-d0", "pd-d1"]
    assert [i.host for i in p.instances if i.cluster == "pd" and i.role == "prefill"] == ["pd-p0"]


def test_profiles_default_to_the_chip_and_model_names():
    p = plan("serving.profiles=null")
    assert dict(p.profiles) == {"prfaas": "h200-paper-1t-hybrid", "pd": "h20-paper-1t-hybrid"}


def test_unknown_policy_is_refused_naming_the_field():
    err = refused("policy.name=round-robin")
    assert "policy.name" in str(err) and "fixed-threshold" in str(err)


def test_unknown_model_is_refused_naming_the_field():
    err = refused("model.name=gpt-17")
    assert "model.name" in str(err) and "paper-1t-hybrid" in str(err)


def test_more_instances_than_the_hosts_hold_are_refused():
    err = refused("serving.instances.prfaas_prefill=5")  # 1 host x per_host 4
    assert err.field == "serving.instances.prfaas_prefill"
    assert "at most 4" in str(err)
    err = refused("serving.per_host=1")  # 2 PrfaaS instances on 1 host
    assert err.field == "serving.instances.prfaas_prefill"


def test_instances_on_a_datacenter_without_hosts_are_refused():
    err = refused("topology.pd.prefill=0")
    assert err.field == "serving.instances.pd_prefill"
    assert "no host" in str(err)


def test_zero_decode_instances_are_refused():
    assert refused("serving.instances.pd_decode=0").field == "serving.instances.pd_decode"


def test_a_tpot_slo_below_one_decode_step_is_refused():
    err = refused("serving.slo.tpot=10ms")  # the H20 profile's step is 25 ms
    assert err.field == "serving.slo.tpot"
    assert "25 ms" in str(err)


@pytest.mark.parametrize("value", ["1.5", "0", "most"])
def test_an_early_stop_bar_outside_0_to_1_is_refused(value):
    assert refused(f"serving.slo.stop_below={value}").field == "serving.slo.stop_below"


def test_the_early_stop_bar_reaches_the_plan_and_is_off_by_default():
    assert plan().spec.slo.stop_below is None
    assert plan("serving.slo.stop_below=0.9").spec.slo.stop_below == 0.9


def test_a_ttft_slo_below_the_fastest_prefill_is_refused():
    err = refused("serving.slo.ttft=100ms")  # one 512-token block takes ~0.4 s on either profile
    assert err.field == "serving.slo.ttft"


def test_a_batch_larger_than_the_decode_profile_allows_is_refused():
    err = refused("serving.bs_max=64")
    assert err.field == "serving.bs_max" and "20" in str(err)


def test_an_unknown_profile_is_refused_naming_the_cluster():
    err = refused("serving.profiles.pd=h100-nonexistent")
    assert "serving.profiles.pd" in str(err)


def test_a_kv_timeout_not_shorter_than_the_request_timeout_is_refused():
    err = refused("serving.timeouts.kv=90s")
    assert "serving.timeouts.kv" in str(err)


def test_a_fault_on_a_missing_instance_is_refused():
    err = refused("serving.faults=[{at: 5s, role: decode, instance: 7}]")
    assert err.field == "serving.faults" and "decode instance 7" in str(err)


def test_unknown_serving_keys_are_refused_listing_the_allowed_ones():
    err = refused("serving.batch=4")
    assert "serving.batch" in str(err) and "bs_max" in str(err)


def test_serving_compute_contradicting_the_model_is_refused():
    err = refused("serving.compute=torch")  # quick sets model.compute: profile
    assert err.field == "serving.compute"


def test_prfaas_run_with_bad_input_prints_one_line_and_starts_nothing(capsys, tmp_path):
    rc = cli_main(["run", "quick", "--out", str(tmp_path / "r"), "--set", "serving.slo.tpot=1ms"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("prfaas run: error:") and err.count("\n") == 1 and "serving.slo.tpot" in err
    assert not (tmp_path / "r").exists()


def test_profile_layers_carry_the_spec_bytes_divided_by_scale():
    spec = load_model_spec("paper-1t-hybrid")
    for tokens, scale in ((8192, 10.0), (1000, 7.0), (131072, 100.0)):
        sizes = wire_layer_bytes(spec, tokens, scale)
        assert len(sizes) == len(spec.layers)
        assert sum(sizes) == round(spec.kv_bytes(tokens).total_bytes / scale)
        assert all(n > 0 for n in sizes)


def test_the_scenario_loader_itself_refuses_counts_that_do_not_fit():
    with pytest.raises(FieldError) as info:
        load_scenario("quick", ["serving.instances.pd_decode=9"])  # 1 decode host x per_host 4
    assert info.value.field == "serving.instances.pd_decode"


def test_early_shedding_is_off_by_default_and_its_budget_is_slack_times_the_ttft_slo():
    assert plan().spec.shed_ttft_s is None
    assert plan("serving.shed.enabled=true", "serving.shed.slack=1.5", "serving.slo.ttft=10s").spec.shed_ttft_s == 15.0
    assert plan("serving.shed.slack=2").spec.shed_ttft_s is None
    err = refused("serving.shed.enabled=true", "serving.shed.slack=0")
    assert err.field == "serving.shed.slack" and "must be > 0" in str(err)


def test_the_kv_congestion_control_defaults_to_the_hosts_and_reaches_the_worker_config(tmp_path):
    from testbed.runner.configs import worker_config
    from testbed.serving.worker import WorkerConfig

    assert plan().spec.kv_congestion_control is None
    scenario = load_scenario("quick", ["serving.kv_congestion_control=reno"])  # reno: built into every Linux kernel
    p = plan_run(scenario)
    assert p.spec.kv_congestion_control == "reno"
    cfg = WorkerConfig.load(worker_config(p.instances[0], p, scenario, 1.0, tmp_path))
    assert cfg.kv_congestion_control == "reno"


def test_the_kv_segment_size_defaults_to_the_paths_and_reaches_the_worker_config(tmp_path):
    from testbed.runner.configs import worker_config
    from testbed.serving.worker import WorkerConfig

    assert plan().spec.kv_mss_bytes is None
    scenario = load_scenario("quick", ["serving.kv_mss=536B"])
    p = plan_run(scenario)
    assert p.spec.kv_mss_bytes == 536
    assert WorkerConfig.load(worker_config(p.instances[0], p, scenario, 1.0, tmp_path)).kv_mss_bytes == 536
    for bad in ("50B", "9000B", "big", "536"):  # a size needs its unit, as every size of a scenario
        err = refused(f"serving.kv_mss={bad}")
        assert "serving.kv_mss" in str(err) and ("88..8948 bytes" in str(err) or "unit" in str(err))


@pytest.mark.parametrize("value", ["CUBIC", "bbr v2", "7", "a_name_that_is_far_too_long"])
def test_a_malformed_congestion_control_name_is_refused_naming_the_field(value):
    err = refused(f"serving.kv_congestion_control={value}")
    assert "serving.kv_congestion_control" in str(err) and "cubic" in str(err)


def test_a_congestion_control_the_kernel_cannot_set_is_refused_before_the_run_with_what_it_has():
    err = refused("serving.kv_congestion_control=nosuchcc")
    assert "serving.kv_congestion_control" in str(err) and "'nosuchcc' cannot be set on this host" in str(err)
    assert "reno" in str(err)  # the kernel's list of what it has


def test_a_cross_traffic_flow_congestion_control_the_kernel_cannot_set_is_refused_before_the_run():
    """iperf3 -C with a name the kernel lacks ended every period's iperf3 at once, and the run went on without that
    flow (2026-12-07): `plan_run` asks this host's kernel, as for the KV's."""
    flows = "cross_traffic={flows: [{name: a, protocol: tcp, direction: prfaas_to_pd}, " \
            "{name: b, protocol: tcp, direction: prfaas_to_pd, congestion: %s}]}"
    err = refused("topology.prfaas.cross=1", "topology.pd.cross=1", flows % "nosuchcc")
    assert "quick.yaml: cross_traffic.flows[1].congestion: 'nosuchcc' cannot be set on this host" in str(err), err
    assert "reno" in str(err)
    assert plan("topology.prfaas.cross=1", "topology.pd.cross=1", flows % "reno").spec is not None  # one the kernel has passes


def test_plan_serving_checks_every_section_but_asks_no_kernel(tmp_path):
    """What a run on other hosts is checked with (`experiments.engine.check_run`): each host's kernel is asked
    there, so a name this host lacks passes, and a malformed one is still refused."""
    from testbed.serving.config import plan_serving

    assert plan_serving(load_scenario("quick", ["serving.kv_congestion_control=nosuchcc"])).spec.kv_congestion_control == "nosuchcc"
    net_only = tmp_path / "net-only.yaml"
    net_only.write_text("name: s\nwan: {rate: 10Gbps}\n")
    scenario = load_scenario(str(net_only), [])  # a file that loads: a network alone
    with pytest.raises(FieldError, match="model: is required for a run"):
        plan_serving(scenario)  # nothing a run could serve


def test_a_congestion_control_refused_for_want_of_permission_says_so_and_names_the_allowed_list(monkeypatch):
    import errno
    import socket

    from testbed.kv import transport

    class Refusing(socket.socket):
        def setsockopt(self, *args):  # as the kernel answers a non-root user for a name not in the allowed list
            raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(transport.socket, "socket", Refusing)
    why = transport.congestion_control_refused("bbr")
    assert why.startswith("'bbr' is not allowed for this user") and "tcp_allowed_congestion_control lists" in why


def test_a_congestion_control_with_a_connector_that_has_none_is_refused(monkeypatch):
    from testbed.serving import config

    monkeypatch.setattr(config, "connector_names", lambda: ("tcp", "memory"))
    err = refused("serving.kv_connector=memory", "serving.kv_congestion_control=cubic")
    assert "serving.kv_congestion_control" in str(err) and "'memory' connector has none" in str(err)
    err = refused("serving.kv_connector=memory", "serving.kv_mss=536B")  # the same for every TCP-only setting
    assert "serving.kv_mss" in str(err) and "'memory' connector has none" in str(err)


def test_a_profile_of_another_model_is_refused_naming_the_cluster_and_both_models(tmp_path):
    """quick with kimi-linear-48b kept the 1T hybrid's profiles, and ran that model's bytes at another's prefill times."""
    err = refused("model.name=kimi-linear-48b")
    assert err.field == "serving.profiles.prfaas" and "is of model 'paper-1t-hybrid', not 'kimi-linear-48b'" in str(err)
    err = refused("serving.profiles.pd=h20-minimax-m2.5")
    assert err.field == "serving.profiles.pd" and "'minimax-m2.5', not 'paper-1t-hybrid'" in str(err)
    unnamed = tmp_path / "mine.csv"  # measured points that name no model are taken as given
    unnamed.write_text("tokens,prefill_s\n1024,0.4\n8192,0.7\n")
    assert dict(plan(f"serving.profiles.prfaas={unnamed}").profiles)["prfaas"] == str(unnamed)
    assert plan("model.name=kimi-linear-48b", "model.compute=torch").compute == "torch"  # a torch run uses no profile


def test_prfaas_model_refuses_a_profile_of_another_model(capsys):
    assert cli_main(["model", "--scenario", "quick", "--set", "model.name=kimi-linear-48b", "--set", "model.compute=torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serving.profiles.prfaas: profile 'h200-paper-1t-hybrid' is of model 'paper-1t-hybrid'" in err[0]
