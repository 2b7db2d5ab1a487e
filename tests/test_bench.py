"""Benchmark arithmetic and scheduling on a fake clock (no wall-time assertions)."""

import pytest

from specprefill.errors import SpecPrefillError
from specprefill.workbench import bench


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
    times = {
        "t_full": [10.0, 12.0, 11.0],
        "t_spec": [2.0, 2.0, 2.0],
        "t_base_kept": [1.0, 1.2, 0.8],
        "t_specprefill": [3.5, 3.0, 4.0],
    }
    parts = {"speculator_s": [2.4, 2.4, 2.4], "scoring_s": [0.1, 0.1, 0.1], "base_s": [1.0, 1.0, 1.0]}
    row = bench.ttft_row(4096, 0.1, times, parts)
    assert row["t_full"] == 11.0 and row["t_specprefill"] == 3.5
    assert row["speedup"] == pytest.approx(11.0 / 3.5)
    assert row["bound"] == pytest.approx(11.0 / (2.0 + 1.0))
    assert row["efficiency"] == pytest.approx((11.0 / 3.5) / (11.0 / 3.0))
    assert row["spec_share"] == pytest.approx(2.0 / 11.0)
    assert row["speedup_min"] == pytest.approx(11.0 / 4.0) and row["speedup_max"] == pytest.approx(4.0)
    o = row["overhead"]
    assert o["look_ahead_s"] == pytest.approx(0.4) and o["scoring_s"] == pytest.approx(0.1)
    assert o["orchestration_s"] == pytest.approx(3.5 - 2.4 - 0.1 - 1.0)


def test_max_qps_ignores_bursts_and_misses():
    from specprefill.serve.loadtest import max_qps, max_qps_by_mode

    rows = [
        {"mode": "vllm", "rate": 0.1, "within_slo": True},
        {"mode": "vllm", "rate": 0.2, "within_slo": False},
        {"mode": "specprefill", "rate": 0.2, "within_slo": True},
        {"mode": "specprefill", "rate": 0.4, "within_slo": False},
        {"mode": "specprefill", "rate": float("inf"), "within_slo": True},
    ]
    assert max_qps_by_mode(rows) == {"vllm": 0.1, "specprefill": 0.2}
    assert max_qps(rows[1:2], "vllm") == 0.0


def test_load_generator_result_to_row():
    from specprefill.serve.loadtest import row

    result = {
        "p50_ttft_ms": 1500.0,
        "p90_ttft_ms": 2500.0,
        "p50_e2el_ms": 3000.0,
        "p90_e2el_ms": 4000.0,
        "request_throughput": 0.4,
        "duration": 20.0,
        "completed": 8,
    }
    r = row("specprefill", 0.5, result, slo_s=2.0)
    assert (r["ttft_p50"], r["ttft_p90"], r["within_slo"]) == (1.5, 2.5, False)
    assert row("vllm", 0.5, result, slo_s=3.0)["within_slo"] is True
    assert row("vllm", 0.5, {**result, "completed": 0}, slo_s=3.0)["within_slo"] is False
    import json

    import numpy as np

    as_numpy = {k: np.float64(v) for k, v in result.items()}  # what the generator may hand back
    assert json.loads(json.dumps(row("vllm", 0.5, as_numpy, slo_s=3.0))) == row("vllm", 0.5, result, slo_s=3.0)


def test_both_servers_get_identical_base_arguments(smollm2):
    """The QPS comparison's two servers come from one EngineParams: `specprefill serve`'s command line parses back to
    exactly those params (so its base is planned from them), and plain vLLM gets exactly the planned base arguments."""
    from specprefill import cli
    from specprefill.config import EngineParams, SpecPrefillConfig
    from specprefill.engines.vllm import planning
    from specprefill.serve import loadtest
    from specprefill.serve.loadtest import server_command

    params = EngineParams(
        speculator="smollm2-135m",
        base="smollm2-135m",
        dtype="float32",
        max_model_len=1024,
        gpu_memory_utilization=0.7,
        kv_cache_memory_bytes=2**28,
        seed=5,
        max_num_seqs=4,
        engine_args={"max_num_partial_prefills": 1},
    )
    config = SpecPrefillConfig(keep_rate=0.2)
    ours = server_command("specprefill", params, config, 8002)
    assert ours[1:4] == ["-m", "specprefill", "serve"]
    args, rest = cli.parser().parse_known_args(ours[3:])
    assert rest == [] and cli.common.engine_params(args) == params and cli.common.config(args) == config
    planned = planning.plan(params).base_kwargs
    assert {"gpu_memory_utilization", "kv_cache_memory_bytes", "seed", "max_num_partial_prefills"} <= set(planned)
    plain = server_command("vllm", params, config, 8001)
    assert plain[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert plain[plain.index("--host") + 2 :] == ["--port", "8001", *loadtest.vllm_flags(planned)]
    for flag, value in (
        ("--dtype", "float32"),
        ("--max-model-len", "1024"),
        ("--max-num-seqs", "4"),
        ("--seed", "5"),
        ("--gpu-memory-utilization", "0.7"),
        ("--served-model-name", "smollm2-135m"),
    ):
        assert plain[plain.index(flag) + 1] == value
    with pytest.raises(SpecPrefillError, match="unknown server kind"):
        server_command("tgi", params, SpecPrefillConfig(), 8003)


def test_bench_table_puts_speculators_side_by_side(tmp_path, capsys):
    import json

    from specprefill.cli import main

    row = {
        "length": 4096,
        "keep_rate": 0.1,
        "t_spec": 1.5,
        "t_base_kept": 0.9,
        "t_full": 12.0,
        "speedup": 4.8,
        "bound": 5.0,
        "efficiency": 0.96,
        "dtype": "bfloat16",
    }
    files = []
    for name, look in (("smollm2-135m", 1), ("self:0.125", 1)):
        path = tmp_path / f"{name}.json"
        path.write_text(
            json.dumps(
                {
                    "rows": [row],
                    "machine": {"cpu_flags": ["avx2", "amx_bf16"]},
                    "config": {"speculator": name, "base": "qwen2.5-coder-1.5b", "specprefill": {"look_ahead": look}},
                }
            )
        )
        files.append(str(path))
    assert main(["bench", "table", *files]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and "bound" in lines[0]
    assert lines[2].startswith(
        "| smollm2-135m | qwen2.5-coder-1.5b | 1 | 4096 | 0.1 | 1.50 | 0.90 | 12.00 | 4.80x | 5.00x | 0.96 | bfloat16 "
        "| avx2 amx_bf16 |"
    )
    assert "self:0.125" in lines[3]
    assert main(["bench", "table", str(tmp_path / "missing.json")]) == 2


def test_batch_of_a_token_budget():
    assert bench.batch_of(None, 4096) == 1 and bench.batch_of(0, 4096) == 1
    assert [bench.batch_of(524288, n) for n in (4096, 8192, 131072)] == [128, 64, 4]
    with pytest.raises(SpecPrefillError, match="token budget 1024 is smaller than a 2048-token prompt"):
        bench.batch_of(1024, 2048)


@pytest.mark.engine
def test_batched_ttft_sweep_runs_each_family_side_by_side(tmp_path, smollm2_cut, monkeypatch):
    """The original's batched regime: budget / length prompts prefilled together, once per configuration family
    (its knobs in each unit's key), resumable: a second sweep reads every unit back without measuring."""
    import json

    from specprefill.config import EngineParams, SpecPrefillConfig
    from specprefill.workbench import speed

    engine = EngineParams(smollm2_cut, base=smollm2_cut, dtype="float32", max_model_len=1024, kv_sequences=4)
    b = bench.Bench(engine, SpecPrefillConfig())
    try:
        rows = speed.ttft_sweep(
            b, [128, 256], [0.5], 1, tmp_path, token_budget=512, warmup=1, families=["p", "p_full_lah8"]
        )
        monkeypatch.setattr(b, "ttft", lambda *a, **k: pytest.fail("a finished unit was measured again"))
        again = speed.ttft_sweep(
            b, [128, 256], [0.5], 1, tmp_path, token_budget=512, warmup=1, families=["p", "p_full_lah8"]
        )
    finally:
        b.llm.shutdown()
    got = [(r["label"], r["length"], r["batch"]) for r in rows]
    assert got == [("p", 128, 4), ("p", 256, 2), ("p_full_lah8", 128, 4), ("p_full_lah8", 256, 2)]
    assert [r["speedup"] for r in again] == [r["speedup"] for r in rows]
    assert all(r["t_full"] > 0 and r["t_base_kept"] > 0 and r["bound"] > 0 and r["warmup"] == 1 for r in rows)
    units = [json.loads(p.read_text())["rows"][0] for p in tmp_path.rglob("*.json") if p.name != "units.json"]
    got = sorted((u["chunk_size"], u["look_ahead"], u["batch"]) for u in units)
    assert got == [(0, 1, 2), (0, 1, 4), (32, 8, 2), (32, 8, 4)]  # each family's knobs in its units


def test_served_within_timeout_and_max_qps_per_category():
    """A request is served when it ended without error within the category's timeout; a rate is sustained when at
    most `tolerance` were not; max QPS is the highest rate before the first one not sustained."""
    from specprefill.serve.loadtest import category_max_qps, served_row

    result = {
        "latencies": [1.0, 9.5, 10.5, 0.0],
        "errors": ["", "", "", "connection reset"],
        "ttfts": [0.2, 0.5, 4.0, 0.0],
        "p50_ttft_ms": 500.0,
        "p90_ttft_ms": 3000.0,
        "duration": 12.0,
    }
    row = served_row(result, timeout_s=10.0, tolerance=1)
    assert (row["served"], row["missed"], row["sustained"]) == (2, 2, False)
    assert row["latency_mean"] == (1.0 + 9.5) / 2 and row["ttft_p90"] == 3.0
    assert served_row(result, timeout_s=11.0, tolerance=1)["sustained"]
    none = served_row({**result, "errors": ["x"] * 4}, 10.0, 4)
    assert none["latency_mean"] is None and none["ttft_p50"] is None and none["sustained"]
    rows = [
        {"category": "c", "mode": "vllm", "rate": 0.2, "sustained": True},
        {"category": "c", "mode": "vllm", "rate": 0.4, "sustained": False},
        {"category": "c", "mode": "vllm", "rate": 0.6, "sustained": True},  # after a failure: does not count
        {"category": "c", "mode": "specprefill", "rate": 0.4, "sustained": True},
        {"category": "c", "mode": "specprefill", "rate": 0.2, "sustained": True},
        {"category": "d", "mode": "vllm", "rate": 0.2, "sustained": False},
    ]
    got = {(r["category"], r["mode"]): r["max_qps"] for r in category_max_qps(rows)}
    assert got == {("c", "vllm"): 0.2, ("c", "specprefill"): 0.4, ("d", "vllm"): 0.0}
    from specprefill.workbench import speed

    cats = {"c": {"keep_rate": 0.1, "timeout_s": 10.0, "rates": [0.2, 0.4]}, "d": {"keep_rate": 0.3, "timeout_s": 20.0}}
    table = speed.qps_table(rows, cats).set_index("category")
    assert table.loc["c", "gain"] == 2.0 and table.loc["d", "max_qps_specprefill"] == 0.0
    assert table["gain"].isna()["d"]


@pytest.mark.parametrize(
    "categories, n, match",
    [
        ({}, 2, "categories is empty"),
        ({"c": {"keep_rate": 0.1, "rates": [1.0]}}, 2, "needs timeout_s"),
        ({"c": {"keep_rate": 0, "timeout_s": 10, "rates": [1.0]}}, 2, "keep_rate 0 must be in"),
        ({"c": {"keep_rate": 0.1, "timeout_s": -1, "rates": [1.0]}}, 2, "timeout_s -1 must be"),
        ({"c": {"keep_rate": 0.1, "timeout_s": 10, "rates": []}}, 2, "rates \\[\\] must be"),
        ({"c": {"keep_rate": 0.1, "timeout_s": 10, "rates": [float("inf")]}}, 2, "rates \\[inf\\] must be"),
        ({"multi-doc QA": {"keep_rate": 0.1, "timeout_s": 10, "rates": [1.0]}}, 0, "n_requests 0 must be"),
        ({"c": 0.3}, 2, "give {keep_rate, timeout_s, rates}"),
    ],
)
def test_qps_categories_are_checked_before_any_server_starts(categories, n, match):
    from specprefill.workbench import speed

    with pytest.raises(SpecPrefillError, match=match):
        speed.qps_requests(categories, "analogue", None, 512, n)


def test_qps_answer_tokens_tolerance_and_burstiness_are_checked(smollm2):
    from specprefill.config import EngineParams, SpecPrefillConfig
    from specprefill.workbench import speed

    cats = {"multi-doc QA": {"keep_rate": 0.1, "timeout_s": 10, "rates": [1.0]}}
    with pytest.raises(SpecPrefillError, match="answer_tokens 0 must be"):
        speed.qps_requests(cats, "analogue", None, 512, 2, answer_tokens=0)
    engine = EngineParams("smollm2-135m", base="smollm2-135m")
    reqs = {"multi-doc QA": [{"prompt": "p", "output_tokens": 2}] * 2}
    for kwargs, match in (({"tolerance": 2}, "tolerance 2 must be an integer in \\[0, 2\\)"),
                          ({"tolerance": 0, "burstiness": 0}, "burstiness 0 must be > 0")):  # fmt: skip
        with pytest.raises(SpecPrefillError, match=match):
            speed.category_qps(engine, SpecPrefillConfig(), cats, reqs, output_dir="unused", **kwargs)
