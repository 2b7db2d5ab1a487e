"""This machine's rates for the time predictions (`workbench.timing`): a timing's numbers turned into the reference
model's rates, cached per machine and code, and nothing measured where it cannot be (models outside the registry
or not materialized, the suite's `SPECPREFILL_TIMING=off`). No engine runs here: the child's timing is exercised
by `reproduce` itself (docs/measurements.md)."""

from __future__ import annotations

import json

import pytest

from specprefill.workbench import cost, eta, timing

MEASURED = {"start_s": 30.0, "prefill_tokens_per_s": 150.0, "step_s": 0.1, "date": "2026-11-28", "machine": {}}


def test_a_timing_becomes_the_reference_models_rates_scaled_by_size():
    r = timing.rates(MEASURED, "qwen2.5-coder-1.5b", "avx512_bf16")  # the reference model itself
    recorded = cost.RATES["avx512_bf16"]
    assert r.prefill == 150.0 and r.step == 0.1 and r.start == 30.0 + timing.KERNEL_S
    assert r.hf_prefill == pytest.approx(recorded.hf_prefill * 150.0 / recorded.prefill)
    assert r.server_start == pytest.approx(recorded.server_start * r.start / recorded.start)
    small = timing.rates(MEASURED, "qwen2.5-coder-0.5b", "avx512_bf16")  # a smaller base: faster per token
    assert small.prefill < r.prefill and small.step > r.step


def test_the_cached_timing_serves_and_each_machine_has_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path))
    monkeypatch.delenv(timing.ENV, raising=False)
    monkeypatch.setattr(timing, "measure", lambda *a: pytest.fail("measured although a timing is cached"))
    pair = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    path = timing._path(*pair)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(MEASURED))
    rates, source = timing.here(*pair, "avx512_bf16")
    assert rates.prefill == 150.0 and "this machine's rates" in source and "2026-11-28" in source
    monkeypatch.setattr(timing.hardware, "cpu_flags", lambda: frozenset({"avx2"}))  # another machine: another key
    assert timing._path(*pair) != path


def test_nothing_is_measured_where_it_cannot_be(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path))
    monkeypatch.delenv(timing.ENV, raising=False)
    monkeypatch.setattr(timing, "measure", lambda *a: pytest.fail("measured"))
    assert timing.here("some/hub-id", "qwen2.5-coder-0.5b", "avx512_bf16") is None  # not the registry's
    monkeypatch.setattr(timing, "is_materialized", lambda name: False)  # a fresh clone before set-up
    assert timing.here("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "avx512_bf16") is None
    monkeypatch.setenv(timing.ENV, "off")
    monkeypatch.setattr(timing, "is_materialized", lambda name: True)
    assert timing.here("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "avx512_bf16") is None
    monkeypatch.delenv(timing.ENV)
    monkeypatch.setattr(timing, "measure", lambda *a: None)  # a failed timing: the class's rates serve
    assert timing.here("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "avx512_bf16") is None
    assert not list(tmp_path.rglob("*.json"))


def test_a_prediction_at_measured_rates_says_so(tmp_path):
    params = {"base": "qwen2.5-coder-1.5b", "speculator": "qwen2.5-coder-0.5b", "dataset": "keyed_records",
              "length": 1024, "n_samples": 10, "keep_rates": [0.1], "max_tokens": 16}  # fmt: skip
    machine = {"cpu_model": "x", "cpu_class": "avx512_bf16", "cpus": 2}
    rates = timing.rates(MEASURED, "qwen2.5-coder-1.5b", "avx512_bf16")
    at_class = eta.predict("cpu", "01_long_context_quality", tmp_path / "s.json", machine, params, {})
    here = eta.predict("cpu", "01_long_context_quality", tmp_path / "s.json", machine, params, {}, None,
                       (rates, "this machine's rates (a timing)"))  # fmt: skip
    assert "avx512_bf16 rates" in at_class[1] and "this machine's rates" in here[1]
    assert here[0] == pytest.approx(cost.seconds("01_long_context_quality", params, "avx512_bf16", None, rates))
    assert here[0] < at_class[0]  # 150 tokens/s here against the class's 103


def test_a_timing_is_measured_once_and_kept_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path))
    monkeypatch.delenv(timing.ENV, raising=False)
    monkeypatch.setattr(timing, "is_materialized", lambda name: True)
    calls = []
    monkeypatch.setattr(timing, "measure", lambda *a: calls.append(a) or dict(MEASURED))
    pair = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    first, second = timing.here(*pair, "avx512_bf16"), timing.here(*pair, "avx512_bf16")
    assert calls == [pair] and first == second and first[0].prefill == 150.0
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [timing._path(*pair).name]  # no temp file left


def test_a_timing_taken_beside_other_work_serves_its_run_but_is_not_kept(tmp_path, monkeypatch):
    """Other processes' share of the CPU is measured over the timing (the machine's busy seconds beyond the timing's
    own); above a quarter the timing serves the run that took it, says so, and is not cached (the next run times
    again): one taken beside the test suite predicted a quiet run 36% slow."""
    assert timing.others_share(busy_s=100.0, own_s=60.0, wall_s=50.0, cpus=2) == pytest.approx(0.4)
    assert timing.others_share(busy_s=55.0, own_s=60.0, wall_s=50.0, cpus=2) == 0.0  # rounding: never negative
    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path))
    monkeypatch.delenv(timing.ENV, raising=False)
    monkeypatch.setattr(timing, "is_materialized", lambda name: True)
    pair = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    for share, kept in ((0.4, False), (0.05, True)):
        monkeypatch.setattr(timing, "measure", lambda *a, s=share: {**MEASURED, "others_share": s})
        rates, source = timing.here(*pair, "avx512_bf16")
        assert rates.prefill == 150.0 and timing._path(*pair).exists() == kept
        assert ("timed beside other work (40% of the CPU): not kept" in source) == (not kept)
    busy = timing._cpu_busy_s()
    assert busy is None or (busy[0] > 0 and busy[1] >= 1)
