"""TTFT of the transformers reference engine on random-weight models of the paper's shapes, built on the device from
their configs (`models.shapes`): full prefill against speculator (prefill, look-ahead, scoring, selection) + pruned
base prefill at the kept tokens' original positions, both to the first token (`logits_to_keep=1`: only the last
position's logits; sdpa runs causal, no dense mask). Absolute times, labelled "transformers reference engine, random
weights": they time the algorithm on this device, not a serving engine."""

from __future__ import annotations

import functools
import random
import time

import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines.hf import capture_speculator
from specprefill.models.shapes import Published
from specprefill.refcheck.checks import build, median_time, sync

LOOK_AHEAD = 8
KEEP_RATES = (0.1, 0.3)
MATMUL_EFFICIENCY = 0.4  # of the measured matmul rate a prefill reaches (attention, norms, launches), for planning
BUILD_S_PER_GPARAM = 2.0  # random initialization on the device, per billion parameters (planning)


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    """Floating-point operations per second of a square matmul on `device` (a short measurement, for planning)."""
    n = 4096 if device.startswith("cuda") else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    sync(device)
    return 10 * 2 * n**3 / max(time.perf_counter() - t0, 1e-9)


def prefill_flops(shape: Published, tokens: int) -> float:
    """One causal prefill: the weights' 2 * parameters per token and the attention's scores and values."""
    attention = 2 * shape.layers * shape.heads * shape.head_dim * tokens * tokens  # QK^T and AV, causal half each
    return 2 * shape.parameters() * tokens + attention


def predicted_s(spec: Published, base: Published, tokens: int, repeats: int, rate: float) -> float:
    """Seconds one cell (every keep rate) takes: full prefill, speculation and pruned prefill, each timed `repeats`
    times after a warm-up, at `MATMUL_EFFICIENCY` of `rate`."""
    full = prefill_flops(base, tokens)
    speculation = prefill_flops(spec, tokens)
    pruned = sum(prefill_flops(base, max(1, int(tokens * p))) for p in KEEP_RATES)
    # full; speculation alone; per keep rate the pruned base alone and speculation + pruned base
    work = full + speculation + pruned + len(KEEP_RATES) * speculation + pruned
    return (repeats + 1) * work / (rate * MATMUL_EFFICIENCY)


def memory_refusal(spec: Published, base: Published, tokens: int, device: str) -> str | None:
    """Why the pair cannot run at `tokens` on this device (bf16 weights, the base's KV, activations), or None."""
    if not device.startswith("cuda"):
        return None
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    weights = 2 * (spec.parameters() + base.parameters())
    kv = 2 * 2 * base.layers * base.kv_heads * base.head_dim * tokens
    activations = 4 * 2 * tokens * max(base.intermediate, spec.intermediate)  # an MLP's gate, up and product
    need = weights + kv + activations
    if need > 0.9 * total:
        return f"needs ~{need / 2**30:.0f} GiB (bf16 weights, KV, activations) of the device's {total / 2**30:.0f} GiB"
    return None


def time_pair(
    names: tuple[str, str], shapes: dict[str, Published], lengths: list[int], device: str, repeats: int, seed: int = 0
) -> list[dict]:
    """One row per prompt length and keep rate (`time_cell`) for the pair `names` (speculator, base), both built on
    the device with random weights and freed afterwards."""
    spec_shape, base_shape = shapes[names[0]], shapes[names[1]]
    models = (build(spec_shape, device, torch.bfloat16, capture=True), build(base_shape, device, torch.bfloat16))
    rng = random.Random(seed)
    rows = []
    for m in lengths:
        low = 1000 if spec_shape.vocab > 4000 else 3  # ordinary tokens, clear of the specials
        ids = [rng.randrange(low, spec_shape.vocab - low) for _ in range(m)]
        rows += [{"speculator": names[0], "base": names[1], **r} for r in time_cell(*models, ids, device, repeats)]
    del models
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def time_cell(spec, base, ids: list[int], device: str, repeats: int) -> list[dict]:
    """Per keep rate: median full-prefill TTFT, median SpecPrefill TTFT (speculation + pruned prefill, end to end),
    the speculation and the pruned prefill alone, speedup, the Amdahl bound full / (speculation + p * full),
    efficiency (speedup / bound), the spread of the repetitions and the peak device memory."""
    ids_t = torch.tensor([ids], device=device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)

    @torch.no_grad()
    def full():
        return base(input_ids=ids_t, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()

    @torch.no_grad()
    def speculate(config: SpecPrefillConfig) -> core.PrunedPrompt:
        captured = capture_speculator(spec, ids, config.look_ahead, set())
        return core.keep(ids, core.token_importance(captured.queries, captured.keys, config, captured.rules), config)

    @torch.no_grad()
    def prefill(pruned: core.PrunedPrompt):
        kept = torch.tensor([pruned.token_ids], device=device)
        positions = torch.tensor([pruned.positions], device=device)
        return base(input_ids=kept, position_ids=positions, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()

    t_full, full_times = median_time(full, device, repeats)
    rows = []
    for p in KEEP_RATES:
        config = SpecPrefillConfig(keep_rate=p, look_ahead=LOOK_AHEAD)
        pruned = speculate(config)
        t_spec, _ = median_time(functools.partial(speculate, config), device, repeats)
        t_pruned, _ = median_time(functools.partial(prefill, pruned), device, repeats)
        t_total, times = median_time(lambda: prefill(speculate(config)), device, repeats)  # noqa: B023 - run now
        bound = t_full / (t_spec + p * t_full)
        rows.append(
            {
                "tokens": len(ids),
                "keep_rate": p,
                "kept": len(pruned.token_ids),
                "full_s": t_full,
                "specprefill_s": t_total,
                "speculation_s": t_spec,
                "pruned_prefill_s": t_pruned,
                "speedup": t_full / t_total,
                "bound": bound,
                "efficiency": t_full / t_total / bound,
                "spread_full_s": [min(full_times), max(full_times)],
                "spread_specprefill_s": [min(times), max(times)],
                "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else None,
            }
        )
    return rows
