"""Benchmark arithmetic and scheduling on a fake clock (no wall-time assertions)."""
import pytest

from specprefill import bench


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_alternate_interleaves_tasks_and_skips_warmup():
    clock, calls = FakeClock(), []
    cost = {"a": 1.0, "b": 2.0, "c": 0.5}

    def task(name):
        def run(rep):
            calls.append((name, rep))
            clock.now += cost[name] + rep  # later reps cost more: alternation must keep them paired
        return run

    times = bench.alternate({n: task(n) for n in "abc"}, reps=3, clock=clock, warmup=1)
    assert calls == [(n, r) for r in (-1, 0, 1, 2) for n in "abc"]
    assert times == {n: [cost[n] + r for r in range(3)] for n in "abc"}


def test_ttft_row_arithmetic():
    times = {"t_full": [10.0, 12.0, 11.0], "t_spec": [2.0, 2.0, 2.0], "t_base_kept": [1.0, 1.2, 0.8],
             "t_specprefill": [3.5, 3.0, 4.0]}
    parts = {"speculator_s": [2.4, 2.4, 2.4], "scoring_s": [0.1, 0.1, 0.1], "base_s": [1.0, 1.0, 1.0]}
    row = bench.ttft_row(4096, 0.1, times, parts)
    assert row["t_full"] == 11.0 and row["t_specprefill"] == 3.5
    assert row["speedup"] == pytest.approx(11.0 / 3.5)
    assert row["bound"] == pytest.approx(11.0 / (2.0 + 1.0))
    assert row["efficiency"] == pytest.approx((11.0 / 3.5) / (11.0 / 3.0))
    assert row["speedup_min"] == pytest.approx(11.0 / 4.0) and row["speedup_max"] == pytest.approx(4.0)
    o = row["overhead"]
    assert o["look_ahead_s"] == pytest.approx(0.4) and o["scoring_s"] == pytest.approx(0.1)
    assert o["orchestration_s"] == pytest.approx(3.5 - 2.4 - 0.1 - 1.0)


def test_poisson_arrivals_rate_and_determinism():
    a = bench.poisson_arrivals(4000, rate=2.0, seed=1)
    assert a == bench.poisson_arrivals(4000, rate=2.0, seed=1)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert len(a) / a[-1] == pytest.approx(2.0, rel=0.08)


def test_percentile_and_max_qps():
    assert bench.percentile([1, 2, 3, 4, 5], 0.5) == 3
    assert bench.percentile([1, 2, 3, 4, 5], 0.9) == pytest.approx(4.6)
    rows = [{"mode": "full", "rate": 0.1, "within_slo": True}, {"mode": "full", "rate": 0.2, "within_slo": False},
            {"mode": "specprefill", "rate": 0.2, "within_slo": True}, {"mode": "specprefill", "rate": 0.4,
                                                                        "within_slo": False}]
    assert bench.max_qps(rows, "full") == 0.1 and bench.max_qps(rows, "specprefill") == 0.2
    assert bench.max_qps(rows[1:2], "full") == 0.0


def test_qps_summary():
    stats = [{"arrival": 0.0, "first": 1.0, "done": 2.0}, {"arrival": 1.0, "first": 4.0, "done": 5.0}]
    row = bench.qps_summary("full", 0.5, stats, slo_s=2.0)
    assert row["ttft_p50"] == pytest.approx(2.0) and row["throughput_rps"] == pytest.approx(2 / 5.0)
    assert row["within_slo"] is False
