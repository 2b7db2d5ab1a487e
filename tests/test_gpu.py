"""`make gpu-check` (scripts/gpu_check.py): what only a CUDA GPU can run, each check reported ran / refused / failed.
Every check compares the GPU engines with the transformers oracle through a plain script in a plain environment
(vLLM's default multiprocess engines, the project sizing memory itself). Not part of CI: no GPU there."""

import pytest
import torch
from test_vllm_engine import run_plain_against_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.engine]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (make gpu-check)", allow_module_level=True)

EAGER = {"enforce_eager": True}


def _speculator_tp() -> dict:
    """The speculator over 2 GPUs' tensor-parallel ranks where there are 2."""
    return {"tensor_parallel_size": 2} if torch.cuda.device_count() >= 2 else {}


def test_v1_runner_matches_the_oracle(tiny_tp_model, tmp_path):
    """vLLM's V1 model runner, both engines eager: selection, importance and greedy tokens equal the oracle's."""
    run_plain_against_oracle(tiny_tp_model, tmp_path, EAGER, {}, env_extra={"VLLM_USE_V2_MODEL_RUNNER": "0"})


def test_v2_runner_async_scheduling_compiled_base(tiny_tp_model, tmp_path):
    """vLLM's V2 model runner (the GPU default), async scheduling and a compiled base (CUDA graphs): the rewritten
    positions, the capture and `min_tokens` bound through V2's own paths."""
    run_plain_against_oracle(
        tiny_tp_model,
        tmp_path,
        {"enforce_eager": False, "async_scheduling": True},
        {},
        env_extra={"VLLM_USE_V2_MODEL_RUNNER": "1"},
    )


def test_tensor_parallel_speculator(tiny_tp_model, tmp_path):
    """The speculator over 2 GPUs (each rank scores its own heads; the driver merges them)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("refused: needs 2 GPUs for a tensor-parallel speculator (this machine has 1)")
    run_plain_against_oracle(tiny_tp_model, tmp_path, EAGER, _speculator_tp())


def test_fp8_kv_cache_base(tiny_tp_model, tmp_path):
    """The base with an FP8 KV cache: the speculator's selection is the oracle's (its cache is its own), the base
    generates from the pruned prompt at its original positions."""
    run_plain_against_oracle(tiny_tp_model, tmp_path, {**EAGER, "kv_cache_dtype": "fp8"}, {}, same_tokens=False)


def _kept_overlap(kept: list[int], reference: list[int]) -> float:
    return len(set(kept) & set(reference)) / max(1, len(reference))


def test_bf16_default_attention_backend(tiny_tp_model, tmp_path):
    """bf16 on the attention backend vLLM picks for this GPU (FlashAttention / FlashInfer refuse float32, so the
    other checks run another one), base compiled. The tolerance is measured, not guessed: vLLM's kept sets must
    overlap the float32 oracle's at least as much as the oracle's own bf16 run does, less 5 points, per prompt;
    the base generates."""
    from test_vllm_engine import PLAIN_CONFIGS, PLAIN_IDS, run_plain

    from specprefill.engines.hf import HFEngine

    got = run_plain(tiny_tp_model, tmp_path, {"dtype": "bfloat16", "enforce_eager": False}, {})
    fp32 = HFEngine(tiny_tp_model, tiny_tp_model, PLAIN_CONFIGS[0], torch.float32)
    bf16 = HFEngine(tiny_tp_model, tiny_tp_model, PLAIN_CONFIGS[0], torch.bfloat16)
    for ids, cfg, g in zip(PLAIN_IDS, PLAIN_CONFIGS, got["outputs"]):
        ref = fp32.speculate([ids], [cfg])[0].kept_indices
        floor = _kept_overlap(bf16.speculate([ids], [cfg])[0].kept_indices, ref) - 0.05
        assert _kept_overlap(g["kept"], ref) >= floor, (cfg, _kept_overlap(g["kept"], ref), floor)
        assert len(g["kept"]) == len(ref) and len(g["tokens"]) > 0


@pytest.fixture(scope="module")
def tiny_long_model(tmp_path_factory):
    """`tiny_tp_model`'s shape with a 32k-token context (random weights: RoPE takes any length)."""
    from conftest import TINY_TP, _tiny_llama

    return _tiny_llama(tmp_path_factory.mktemp("tiny_long"), 1, **{**TINY_TP, "max_position_embeddings": 32768})


def test_long_prompt_through_chunked_prefill(tiny_long_model, tmp_path):
    """A 16,400-token prompt through chunked prefill (2,048-token chunks) on both engines: the speculator's
    selection equals the one it makes with the whole prompt in one chunk, and the base generates from it."""
    from test_vllm_engine import PLAIN_CONFIGS, run_plain

    ids = [[1] + [3 + (i * 7) % 61 for i in range(16400)]]
    cfgs = PLAIN_CONFIGS[:1]
    runs = {}
    for chunk in (2048, 20480):
        engine = {"max_model_len": 20480, "max_num_batched_tokens": chunk, "enable_chunked_prefill": True}
        out = tmp_path / str(chunk)
        out.mkdir()
        runs[chunk] = run_plain(tiny_long_model, out, engine, dict(engine), ids=ids, cfgs=cfgs)["outputs"][0]
    assert runs[2048]["kept"] == runs[20480]["kept"]
    assert len(runs[2048]["kept"]) < len(ids[0]) and len(runs[2048]["tokens"]) > 0


def test_server_concurrent_keep_rates(tiny_tp_model, tmp_path):
    """`specprefill serve` on the GPU: 9 requests of mixed lengths at keep rates 0.1 / 0.3 / 1.0 sent together keep
    exactly the counts each keeps alone (the keep rate is per request), and every request answers."""
    import asyncio
    import subprocess
    import sys

    import openai
    from conftest import plain_env

    from specprefill.engines.vllm.async_engine import KEEP_RATE_KEY
    from specprefill.serve.loadtest import free_port, stop, wait_healthy

    port, log = free_port(), tmp_path / "server.log"
    env = plain_env()
    command = [sys.executable, "-m", "specprefill", "serve", tiny_tp_model, "--speculator", tiny_tp_model]
    command += ["--min-prompt-tokens", "64", "--max-model-len", "1024", "--port", str(port)]
    command += ["--enable-prompt-tokens-details"]  # the tokens kept are shown only then
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    prompts = [" ".join(f"w{(i * 7 + j) % 60}" for i in range(150 + 67 * j % 300)) for j in range(9)]
    rates = [(0.1, 0.3, 1.0)[j % 3] for j in range(9)]
    try:
        wait_healthy(proc, url, "the GPU server", str(log), timeout_s=600)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")

        async def one(prompt, rate):
            r = await client.completions.create(
                model=tiny_tp_model,
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"vllm_xargs": {KEEP_RATE_KEY: rate}},
            )
            info = r.model_extra["specprefill"]
            return info["n_prompt_tokens"], info["n_kept_tokens"], r.usage.completion_tokens

        async def both():
            alone = [await one(p, r) for p, r in zip(prompts, rates)]
            return alone, await asyncio.gather(*[one(p, r) for p, r in zip(prompts, rates)])

        alone, together = asyncio.run(both())
    finally:
        stop(proc)
    assert [(m, k) for m, k, _ in together] == [(m, k) for m, k, _ in alone]
    assert all(n > 0 for _, _, n in together)
    assert [k < m for m, k, _ in alone] == [rate < 1 for rate in rates]


def test_peak_memory_within_the_plan(tiny_tp_model, tmp_path, record_property):
    """With both engines alive after generating, the device memory in use (both engines' processes, the script's
    CUDA context) stays within the plan's shares of the GPU (`gpu_memory_utilization` of base + speculator) plus
    1 GiB for the script's context and allocator slack."""
    from test_vllm_engine import run_plain

    memory = run_plain(tiny_tp_model, tmp_path, {"enforce_eager": True}, {})["memory"]
    base_util, spec_util = memory["planned"]
    planned = (base_util + spec_util) * memory["total"]
    record_property("used_gib", round(memory["used"] / 2**30, 2))
    record_property("planned_gib", round(planned / 2**30, 2))
    assert memory["used"] <= planned + 2**30, memory


def test_ttft_speedup_offline_pair(tmp_path, record_property):
    """`specprefill bench ttft` on the project's offline pair (Qwen2.5-Coder 0.5B speculating for 1.5B, from their
    PyPI packages) at 4k and 8k tokens, keep rate 0.1: the speedup over full prefill is recorded in the report
    (a number for the first GPU, not a pass mark); the check fails only if the bench does."""
    import json
    import subprocess
    import sys

    args = ["bench", "ttft", "--speculator", "qwen2.5-coder-0.5b", "--base", "qwen2.5-coder-1.5b"]
    args += ["--lengths", "4096,8192", "--keep-rates", "0.1", "--reps", "3", "--out", str(tmp_path), "--json"]
    proc = subprocess.run([sys.executable, "-m", "specprefill", *args], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    for row in rows:
        record_property(f"speedup_{row['length']}", round(row["speedup"], 2))
    assert rows and all(row["speedup"] > 0 for row in rows)
