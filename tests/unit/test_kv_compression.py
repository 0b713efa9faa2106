"""`policy.kv_compression` (docs/router.md, "Adaptive KV precision"): which offloads send float8, what the law
predicts for them, what the wire carries in each compute mode, and how the decode gets its dtype back."""

from __future__ import annotations


import pytest

from testbed import clock
from testbed.errors import FieldError
from testbed.models.spec import load_model_spec
from testbed.serving.compute import cast_full_attention, delta_layer_bytes, restore_kv_dtype
from testbed.serving.policy import SchedulerLog, TelemetrySample, build_policy
from testbed.serving.protocol import KVDestination, PrefillRequest
from tests.unit.test_policy import CAP, DECODE, PREFILL, drive, req, spec, state

K = 1024
FP8 = "float8_e4m3fn"


def make(name: str = "prfaas", ratio: float = 0.5, **kw: object):
    return build_policy(spec(name=name, signals="oracle", **kw), PREFILL, DECODE, log=SchedulerLog(), capacity_bps=CAP,
                        compressed_kv_ratio=ratio)


# ----------------------------------------------------------------------------------------- the section


def test_the_default_is_none_and_off_in_yaml_reads_as_none() -> None:
    assert spec().kv_compression == "none"
    assert spec(kv_compression=False).kv_compression == "none"  # `kv_compression: off` in YAML is false
    assert spec(kv_compression="fp8").kv_compression == "fp8"
    assert spec(kv_compression="adaptive").to_mapping()["kv_compression"] == "adaptive"


@pytest.mark.parametrize("section, message", [
    ({"kv_compression": "int4"}, "'int4' is not allowed; use one of: none, fp8, adaptive"),
    ({"kv_compression": True}, "True is not allowed"),
    ({"name": "fixed-threshold", "kv_compression": "adaptive"}, "'adaptive' follows the prfaas control law"),
])
def test_a_bad_kv_compression_names_the_field(section: dict, message: str) -> None:
    with pytest.raises(FieldError, match="policy.kv_compression") as exc:
        spec(**section)
    assert message in str(exc.value)


# -------------------------------------------------------------------------------------------- decisions


@pytest.mark.parametrize("name", ["fixed-threshold", "prfaas"])
def test_fp8_compresses_every_offload_and_never_a_local_prefill(name: str) -> None:
    pol = make(name, threshold="8K", kv_compression="fp8")
    long, short = pol.decide(req(20 * K, "a"), state(input_len=20 * K)), pol.decide(req(2 * K, "b"), state(input_len=2 * K))
    assert (long.route, long.compress_kv) == ("prfaas", True)
    assert (short.route, short.compress_kv) == ("pd", False)  # PD-P's KV stays inside the datacenter
    assert [r["compress_kv"] for r in pol.log.rows("decision")] == [True, False]


def test_none_never_compresses() -> None:
    pol = make("prfaas", threshold="8K")
    assert not pol.decide(req(20 * K), state(input_len=20 * K)).compress_kv


def test_adaptive_compresses_at_the_first_pressure_before_any_raise_and_stops_once_calm_in_the_model_dtype() -> None:
    pol = make(threshold="8K", kv_compression="adaptive", control={"hold": "3s"})
    t0 = clock.now_s()
    drive(pol, t0, 3.0, 0.3)
    assert not pol.decide(req(20 * K, "a"), state(input_len=20 * K)).compress_kv
    drive(pol, t0 + 3.0, 2.0, 1.0)  # the line saturates and committed KV backs up
    on = pol.log.rows("kv_compression")
    assert on and on[0]["compress_kv"] is True and on[0]["reason"].startswith("compress: committed KV")
    assert on[0]["t_s"] == pytest.approx(t0 + 3.1)  # the first tick of the saturated line
    first_raise = pol.log.rows("threshold")
    assert not first_raise or first_raise[0]["t_s"] >= on[0]["t_s"]  # compression comes first
    assert pol.decide(req(120 * K, "b"), state(input_len=120 * K)).compress_kv  # above any raise so far
    drive(pol, t0 + 5.0, 60.0, 0.1)  # calm for a minute: the raise is given back, then compression
    assert pol.threshold == 8 * K
    off = pol.log.rows("kv_compression")[-1]
    assert off["compress_kv"] is False and off["reason"].startswith("uncompress: ")
    assert all(r["t_s"] <= off["t_s"] for r in pol.log.rows("threshold"))  # t back at base before the dtype
    assert not pol.decide(req(20 * K, "c"), state(input_len=20 * K)).compress_kv
    assert [r["compress_kv"] for r in pol.log.rows("kv_compression")] == [True, False]  # no flapping


def test_adaptive_stays_compressed_while_the_model_dtype_would_not_be_calm() -> None:
    """Calm on float8 KV is not calm: the model dtype's predicted demand must fit below low_utilization."""
    pol = make(threshold="1K", min_threshold="1K", kv_bytes_per_token="1MB", kv_compression="adaptive",
               control={"min_samples": 4, "hold": "1s"})
    t0 = clock.now_s()
    for i in range(8):  # 8 x 32K arrivals in 8 s: 32 GB/s x 8 = 256 Gbps in the model's dtype, 128 Gbps in float8
        pol.decide(req(32 * K, f"r{i}"), state(input_len=32 * K, now=t0 + i))
    ctl = pol.controller
    ctl.compressing = True
    full, comp = ctl.predicted_demand_bps(ctl.t, t0 + 8, compressed=False), ctl.predicted_demand_bps(ctl.t, t0 + 8, compressed=True)
    assert comp == pytest.approx(0.5 * full)
    ctl.capacity_bps = full  # over the next 4 s (the window's span grows to 12 s): float8 demand 33-50% of it (calm), the model dtype's 67-100% (not)
    for k in range(40):
        now = t0 + 8 + 0.1 * k
        pol.on_telemetry(TelemetrySample(now, egress_bps=0.1 * ctl.capacity_bps, capacity_bps=ctl.capacity_bps))
        ctl.step(now)
    assert ctl.compressing and not pol.log.rows("kv_compression")
    ctl.capacity_bps = 3.0 * full  # now the model dtype's demand is calm too (22-33%)
    for k in range(40, 60):
        now = t0 + 8 + 0.1 * k
        pol.on_telemetry(TelemetrySample(now, egress_bps=0.1 * ctl.capacity_bps, capacity_bps=ctl.capacity_bps))
        ctl.step(now)
    assert not ctl.compressing and [r["compress_kv"] for r in pol.log.rows("kv_compression")] == [False]


# ------------------------------------------------------------------------------------- the size model


def test_the_float8_size_is_the_measured_line_with_its_slope_shrunk_until_float8_transfers_are_measured() -> None:
    pol = make(threshold="8K", kv_compression="fp8", ratio=0.5)
    ctl = pol.controller
    for n in (10 * K, 20 * K, 40 * K):  # model dtype: 100 MB of state + 2 kB per token
        ctl.observe(TelemetrySample(1.0, transfer_uncached_len=n, transfer_kv_bytes=int(100e6 + 2000 * n)))
    full, comp = ctl.kv_bytes_model(compressed=False), ctl.kv_bytes_model()
    assert full(30 * K) == pytest.approx(100e6 + 2000 * 30 * K)
    assert comp(30 * K) == pytest.approx(100e6 + 1000 * 30 * K)  # the state crosses as it is
    for n in (10 * K, 30 * K):  # measured float8 transfers take over
        ctl.observe(TelemetrySample(2.0, transfer_uncached_len=n, transfer_kv_bytes=int(90e6 + 900 * n), transfer_compressed=True))
    assert ctl.kv_bytes_model()(20 * K) == pytest.approx(90e6 + 900 * 20 * K)
    assert ctl.kv_bytes_model(compressed=False)(20 * K) == pytest.approx(100e6 + 2000 * 20 * K)  # the model fit kept its own


def test_with_one_measured_transfer_the_float8_size_falls_back_to_the_model_dtype_not_to_none() -> None:
    ctl = make(threshold="8K", kv_compression="fp8").controller
    assert ctl.kv_bytes_model() is None  # nothing measured, no prior
    ctl.observe(TelemetrySample(1.0, transfer_uncached_len=10 * K, transfer_kv_bytes=int(100e6 + 2000 * 10 * K)))
    assert ctl.kv_bytes_model()(10 * K) == pytest.approx(100e6 + 2000 * 10 * K)  # unshrunk: an overestimate


def test_the_wire_bytes_of_a_float8_offload_halve_the_full_attention_part_only() -> None:
    s = load_model_spec("paper-1t-hybrid")
    n = 30000
    full, comp = sum(delta_layer_bytes(s, n, 0, 1.0)), sum(delta_layer_bytes(s, n, 0, 1.0, FP8))
    kv = s.kv_bytes(n)
    assert full == kv.total_bytes
    assert comp == kv.fixed_state_bytes + kv.full_attention_bytes // 2


# -------------------------------------------------------------------------------------------- the wire


def test_prefill_request_carries_the_wire_dtype_and_refuses_an_unknown_one() -> None:
    r = PrefillRequest("r1", 100, KVDestination("10.0.0.1", 9000, 0), kv_dtype=FP8)
    assert PrefillRequest.from_json(r.to_json()).kv_dtype == FP8
    assert PrefillRequest.from_json({**r.to_json(), "kv_dtype": "fp8"}).kv_dtype == FP8
    assert PrefillRequest.from_json({k: v for k, v in r.to_json().items() if k != "kv_dtype"}).kv_dtype is None
    with pytest.raises(FieldError, match="kv_dtype: 'int3' is not a cache dtype"):
        PrefillRequest.from_json({**r.to_json(), "kv_dtype": "int3"})


def test_float8_on_the_wire_keeps_the_state_saturates_the_range_and_comes_back_within_e4m3_precision() -> None:
    torch = pytest.importorskip("torch")
    from testbed.kv.cache import KVCache, LayerKV

    g = torch.Generator().manual_seed(0)
    latent = (torch.randn(64, 512, generator=g) * 4).to(torch.bfloat16)
    latent[0, 0], latent[0, 1] = 1000.0, -1000.0  # beyond float8 e4m3's finite range (448)
    state_t = torch.randn(2, 8, 8, generator=g).to(torch.bfloat16)
    mla = LayerKV(3, "mla", {"latent": latent, "k_rope": latent[:, :64].clone()})
    lin = LayerKV(0, "linear", {"state": state_t, "conv": torch.zeros(3, 16, dtype=torch.bfloat16)})
    wire = [cast_full_attention(lin, FP8), cast_full_attention(mla, FP8)]
    assert wire[0] is lin  # a recurrent state is never rounded
    assert all(t.dtype == torch.float8_e4m3fn for t in wire[1].tensors.values())
    assert wire[1].nbytes * 2 == mla.nbytes
    back = restore_kv_dtype(KVCache("r", "m", 64, wire), "bfloat16")
    got = back.layers[1].tensors["latent"]
    assert got.dtype == torch.bfloat16 and not torch.isnan(got.float()).any()
    assert got[0, 0].item() == 448.0 and got[0, 1].item() == -448.0
    ref, out = latent.float()[1:], got.float()[1:]
    normal = ref.abs() >= 2.0 ** -6  # e4m3's smallest normal; below it the absolute error is at most 2^-10
    rel = ((out - ref).abs() / ref.abs())[normal]
    assert rel.max().item() <= 2.0 ** -4 + 1e-6  # 3 mantissa bits: half an ulp is 1/16 of the value
    assert ((out - ref).abs()[~normal]).max().item() <= 2.0 ** -10 + 1e-9
    assert torch.equal(back.layers[0].tensors["state"], state_t)


# ------------------------------------------------------------------------------------------ the summary


def test_the_summary_gives_the_share_of_offloads_that_sent_float8() -> None:
    import pandas as pd

    from analysis.metrics import float8_share

    df = pd.DataFrame({"route": ["prfaas", "prfaas", "prfaas", "pd"],
                       "kv_dtype": [FP8, "bfloat16", FP8, "bfloat16"]})
    assert float8_share(df) == pytest.approx(2 / 3)  # PD-P's request is not an offload
    assert float8_share(df[df["route"] == "pd"]) is None
    assert float8_share(df.drop(columns="kv_dtype")) is None  # a run recorded before the column


def test_a_decode_keeps_float8_kv_for_its_own_request_and_out_of_its_prefix_pool() -> None:
    """A later request with the same prefix must not be served rounded blocks as the model's own: the decode
    pool takes the blocks of a request whose KV crossed in the model's dtype, not of one that crossed in float8."""
    pytest.importorskip("torch")
    from testbed.clock import now_s
    from testbed.kv.pool import chain_block_hashes
    from testbed.kv.transport import ReceivedKV
    from testbed.models.torch_model import synthetic_cache
    from testbed.serving.protocol import DecodeRequest, FinalEvent
    from tests.unit.test_worker import torch_decode_worker

    worker = torch_decode_worker()
    try:
        spec = worker.compute.model.spec
        tokens = 1024  # two full blocks before the prompt's last token
        hashes = {rid: tuple(chain_block_hashes(range(i, i + 3))) for i, rid in ((0, "bf16"), (100, "fp8"))}
        slots = {rid: worker.register(DecodeRequest(rid, tokens + 1, output_len=2, prompt_token_ids=tuple(i % 200 for i in range(tokens + 1)),
                                                    block_hashes=hashes[rid], kv_dtype=FP8 if rid == "fp8" else None))
                 for rid in hashes}
        for rid in hashes:
            c = synthetic_cache(spec, tokens, rid, seed=1)
            if rid == "fp8":
                c.layers = [cast_full_attention(layer, FP8) for layer in c.layers]
            worker._on_kv(rid, ReceivedKV(rid, True, None, c, c.nbytes, c.nbytes, 1, now_s(), now_s()))
        for rid, slot in slots.items():
            events = [slot.events.get(timeout=30)]
            while not isinstance(events[-1], FinalEvent):
                events.append(slot.events.get(timeout=30))
            assert events[-1].status == "ok", (rid, events[-1].reason)
        assert worker.pool.match(list(hashes["bf16"]), max_tokens=tokens).tokens == tokens
        assert worker.pool.match(list(hashes["fp8"]), max_tokens=tokens).tokens == 0
    finally:
        worker.receiver.close()


@pytest.mark.parametrize("mode", ["none", "fp8", "adaptive"])
def test_prfaas_check_judges_the_line_on_what_each_mode_sends(mode: str) -> None:
    """`fp8`: every offload is float8, so the dip's offered/left is the float8 figure; `adaptive`: the model
    dtype's (it compresses only under pressure), with the float8 figure beside it."""
    from analysis.scenario_check import check_scenario, format_report
    from testbed.scenario import builtin_scenarios_dir
    from testbed.sections import load_scenario

    rep = check_scenario(load_scenario(str(builtin_scenarios_dir() / "case-study.yaml"), [f"policy.kv_compression={mode}"]))
    dip = next(s for s in rep.segments if s.capacity_bps < 50e9)
    left = dip.capacity_bps - dip.cross_bps
    assert rep.offered_kv_model_dtype_bps == pytest.approx(8.14e9, rel=0.01)
    if mode == "none":
        assert rep.offered_kv_compressed_bps is None and dip.utilisation == pytest.approx(rep.offered_kv_model_dtype_bps / left)
        return
    assert rep.offered_kv_compressed_bps == pytest.approx(4.88e9, rel=0.01)  # 31-43% less per offload
    sent = rep.offered_kv_compressed_bps if mode == "fp8" else rep.offered_kv_model_dtype_bps
    assert rep.offered_kv_bps == sent and dip.utilisation == pytest.approx(sent / left)
    assert "float8" in format_report(rep)
