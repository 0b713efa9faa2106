"""Telemetry sampler: achieved rate from byte deltas, scale applied, listeners called, parquet written."""

import pandas as pd

from testbed.net.telemetry import Telemetry


def test_samples_compute_achieved_rate_and_reach_listeners(tmp_path, monkeypatch):
    clock_s = iter([10.0, 10.1, 10.2])
    monkeypatch.setattr("testbed.net.telemetry.clock.now_s", lambda: next(clock_s))
    tx = iter([0, 1_250_000, 2_500_000])  # 1.25 MB per 100 ms = 100 Mbps
    tel = Telemetry(lambda d: {"tx_bytes": next(tx), "rate_bps": 1e8}, ("prfaas_to_pd",), t0_s=10.0, scale=20)
    seen = []
    tel.add_listener(seen.append)
    for _ in range(3):
        tel.sample_once()
    assert [round(r["t_s"], 3) for r in seen] == [0.0, 0.1, 0.2]
    assert seen[0]["achieved_bps"] == 0.0
    assert abs(seen[2]["achieved_bps"] - 1e8) < 1
    assert abs(seen[2]["achieved_emulated_bps"] - 2e9) < 20
    df = pd.read_parquet(tel.write_parquet(tmp_path / "link.parquet"))
    assert list(df.t_s.round(3)) == [0.0, 0.1, 0.2] and set(df.direction) == {"prfaas_to_pd"}


def test_a_failing_listener_does_not_stop_sampling(monkeypatch):
    tel = Telemetry(lambda d: {"tx_bytes": 0}, ("a", "b"), t0_s=0.0, scale=1)
    tel.add_listener(lambda s: 1 / 0)
    assert len(tel.sample_once()) == 2 and tel.errors == 2


def test_a_sampler_that_keeps_no_rows_still_feeds_its_listeners():
    """The WAN control process samples for hours under `prfaas net up`: its runner keeps the rows, it does not."""
    tel = Telemetry(lambda d: {"tx_bytes": 0}, ("a", "b"), t0_s=0.0, scale=1, keep_rows=False)
    seen = []
    tel.add_listener(seen.append)
    tel.sample_once()
    tel.sample_once()
    assert len(seen) == 4 and tel.rows == []
