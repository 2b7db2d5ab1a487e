"""The reference engine's device checks (`scripts/gpu_check.py --engine hf`): what the paper's claims rest on that
needs no vLLM — the scoring (`core`), the selection, original positions with non-contiguous `position_ids`, and the
transformers reference engine — run on a CUDA device against the CPU, and the first TTFT numbers of the reference
engine on random-weight models of the paper's shapes. Needs torch and transformers only (and what transformers
installs: numpy, PyYAML, safetensors, tokenizers): no vLLM, no network, no model files (the tiny checkpoints are
written to a temporary folder, the large models are built from their configs on the device).

The same checks run on the CPU with tiny shapes (`TINY`, the device being the CPU) in the default test loop, so
they cannot rot. Each check is reported as ran, refused (with its reason) or failed (`refcheck.run`)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines import hf
from specprefill.engines.hf import HFEngine
from specprefill.models.shapes import PUBLISHED, Published
from specprefill.models.tiny import FAMILIES, tiny_checkpoint

CHECKS = {
    "families": "every decoder family of tests/test_families.py (tiny random weights): the reference engine on the "
    "device in bf16 (sdpa; a FlashAttention-2 base where installed) against itself on the CPU in float32 - importance "
    "distance <= 2x the CPU's own bf16-vs-float32 distance, kept-set Jaccard >= 0.9 (or the CPU bf16 run's own, if "
    "lower), greedy tokens equal in float32 with original positions, and at keep 1.0 (float32) the logits of a plain "
    "forward (no position_ids) within 1e-4 of their scale, decode steps included",
    "core": "core scoring, pooling and selection on the device at long prompts against the CPU (float32)",
    "ttft": "TTFT of the transformers reference engine, random weights, bf16: full prefill vs speculator + pruned "
    "base (original positions), keep 0.1/0.3, median of the repetitions after a warm-up, the Amdahl bound, "
    "efficiency and peak device memory",
}
FAMILY_CONFIG = SpecPrefillConfig(keep_rate=0.3, chunk_size=4, look_ahead=3, pool_kernel=3)
PAPER_PAIR = ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct")  # speculator, base


@dataclass(frozen=True)
class Scale:
    """How large each check runs: `GPU` on a CUDA device, `TINY` on the CPU in the tests."""

    name: str
    core_lengths: tuple[int, ...]
    core_shape: tuple[int, int, int, int, int]  # layers, heads, kv heads, look-ahead steps, head dim
    ttft_lengths: tuple[int, ...]
    pairs: tuple[tuple[str, str], ...]  # (speculator, base) shapes
    repeats: int = 3
    shapes: dict[str, Published] = field(default_factory=lambda: dict(PUBLISHED))
    family_prompts: int = 3  # prompts per family (lengths 150, 97, 201)


TINY_SHAPES = {
    "tiny-speculator": Published(2, 4, 2, 16, 64, 128, 16384, 0, "float32", vocab=256),
    "tiny-base": Published(3, 4, 2, 16, 64, 192, 16384, 0, "float32", vocab=256),
}
GPU = Scale(
    "gpu",
    (32768, 131072),
    (4, 32, 8, 8, 128),
    (8192, 32768, 65536),
    (
        ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
        ("meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    ),
)
TINY = Scale("tiny", (512, 2048), (2, 4, 2, 4, 16), (128, 256), (("tiny-speculator", "tiny-base"),), 3, TINY_SHAPES, 1)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean absolute difference of two importance vectors, relative to the second's mean magnitude."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12))


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / max(1, len(a | b))


@torch.no_grad()
def _logits(model, ids: list[int], positions, follow: list[int], follow_positions) -> torch.Tensor:
    """Last-position logits of a prefill of `ids` and of each teacher-forced next token, float32 on the CPU;
    `positions` None: transformers' own positions (a plain forward), else explicit `position_ids`."""
    from transformers import DynamicCache  # lazy: transformers

    cache, device = DynamicCache(config=model.config), model.device

    def tensor(x):
        return None if x is None else torch.tensor([x], device=device)

    out = model(input_ids=tensor(ids), position_ids=tensor(positions), past_key_values=cache, logits_to_keep=1)
    rows = [out.logits[0, -1]]
    for token, position in zip(follow, follow_positions):
        p = None if position is None else [position]
        out = model(input_ids=tensor([token]), position_ids=tensor(p), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float().cpu()


def positions_error(model, ids: list[int], steps: int) -> float:
    """Keep 1.0 through `core.prune` (explicit original positions, decode positions from `decode_position`) against
    a plain forward of the same tokens: the largest logit difference relative to the logits' scale (0 when the
    project's positions are transformers' own)."""
    pruned = core.prune(ids, list(range(len(ids))), FAMILY_CONFIG)
    plain = _logits(model, ids, None, [], [])
    follow = [int(plain[0].argmax())] * steps  # any tokens do: both runs are fed the same
    plain = _logits(model, ids, None, follow, [None] * steps)
    explicit = _logits(
        model, pruned.token_ids, pruned.positions, follow, [pruned.decode_position(s) for s in range(steps)]
    )
    return float((explicit - plain).abs().max() / plain.abs().max().clamp_min(1e-12))


def check_families(
    device: str, folder: Path, families: list[str] | None = None, n_prompts: int = 3, max_tokens: int = 6
) -> dict:
    """`CHECKS["families"]`: one row per family and prompt; failures named."""
    from transformers.utils import is_flash_attn_2_available  # lazy: transformers

    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 64) for _ in range(n - 1)] for n in (150, 97, 201)][:n_prompts]
    fa2 = device.startswith("cuda") and is_flash_attn_2_available()
    rows, failures = [], []
    for i, family in enumerate(families or list(FAMILIES)):
        path = tiny_checkpoint(folder / family, family, seed=i)
        engines = {
            (dtype, where): HFEngine(path, path, FAMILY_CONFIG, dtype, where)
            for dtype in (torch.float32, torch.bfloat16)
            for where in ("cpu", device)
        }
        ref, cpu16 = engines[(torch.float32, "cpu")], engines[(torch.bfloat16, "cpu")]
        dev16, dev32 = engines[(torch.bfloat16, device)], engines[(torch.float32, device)]
        flash = HFEngine(path, path, FAMILY_CONFIG, torch.bfloat16, device, "flash_attention_2") if fa2 else None
        for j, ids in enumerate(prompts):
            want, own, got = (e.speculate([ids], [FAMILY_CONFIG])[0] for e in (ref, cpu16, dev16))
            own_d = distance(torch.tensor(own.importance), torch.tensor(want.importance))
            dev_d = distance(torch.tensor(got.importance), torch.tensor(want.importance))
            jac, own_jac = jaccard(got.kept_indices, want.kept_indices), jaccard(own.kept_indices, want.kept_indices)
            tokens = dev32.generate([ids], max_tokens)[0].output_token_ids
            ref_tokens = ref.generate([ids], max_tokens)[0].output_token_ids
            position_error = positions_error(dev32.base, ids, max_tokens)
            row = {
                "family": family,
                "prompt": j,
                "distance": dev_d,
                "cpu_bf16_distance": own_d,
                "jaccard": jac,
                "cpu_bf16_jaccard": own_jac,
                "tokens_equal": tokens == ref_tokens,
                "keep_1_position_error": position_error,
            }
            if flash is not None:
                row["fa2_tokens_equal_sdpa"] = (
                    flash.generate([ids], max_tokens)[0].output_token_ids
                    == dev16.generate([ids], max_tokens)[0].output_token_ids
                )
            rows.append(row)
            why = []
            if dev_d > 2 * own_d + 1e-6:
                why.append(f"importance distance {dev_d:.2e} > 2x the CPU bf16's {own_d:.2e}")
            if jac < min(0.9, own_jac):
                why.append(f"kept-set Jaccard {jac:.3f} < {min(0.9, own_jac):.3f}")
            if tokens != ref_tokens:
                why.append(f"float32 tokens {tokens} != the CPU's {ref_tokens}")
            if position_error > 1e-4:
                why.append(f"keep 1.0 with explicit positions: logits {position_error:.1e} from a plain forward's")
            if why:
                failures.append(f"{family} prompt {j}: " + "; ".join(why))
    return {"rows": rows, "failures": failures, "flash_attention_2": fa2}


def check_core(device: str, scale: Scale, seed: int = 0) -> dict:
    """`CHECKS["core"]`: importance (scores, pooling, aggregation) and the kept set on the device against the CPU."""
    layers, heads, kv, steps, dim = scale.core_shape
    config = SpecPrefillConfig(keep_rate=0.1, chunk_size=32, pool_kernel=13, look_ahead=steps)
    rows: list[dict] = []
    failures: list[str] = []
    for m in scale.core_lengths:
        g = torch.Generator().manual_seed(seed + m)
        queries = torch.randn(layers, heads, steps, dim, generator=g) * 2.0
        keys = torch.randn(layers, kv, m, dim, generator=g)
        want = core.token_importance(queries, keys, config)
        kept_cpu = core.select(want, config)
        with _no_tf32():
            t0 = time.perf_counter()
            got = core.token_importance(queries.to(device), keys.to(device), config)
            kept = core.select(got, config)
            sync(device)
            seconds = time.perf_counter() - t0
        err = float((got.cpu() - want).abs().max() / want.abs().max())
        jac = jaccard(kept.cpu().tolist(), kept_cpu.tolist())
        rows.append({"tokens": m, "max_relative_error": err, "jaccard": jac, "device_s": round(seconds, 4)})
        if err > 1e-3 or jac < 0.99:
            failures.append(f"{m} tokens: relative error {err:.2e} (<= 1e-3), kept-set Jaccard {jac:.4f} (>= 0.99)")
    m = scale.core_lengths[0]
    layout = synthetic_layout(m, seed)
    importance = torch.rand(m, generator=torch.Generator().manual_seed(seed))
    structured = SpecPrefillConfig(keep_rate=0.1, selection_unit="records", protect=True, query_weight=0.5)
    want_kept = core.select(importance, structured, layout)
    t0 = time.perf_counter()
    got_kept = core.select(importance.to(device), structured, layout)
    sync(device)
    seconds = time.perf_counter() - t0
    same = got_kept.device.type == torch.device(device).type and got_kept.cpu().tolist() == want_kept.tolist()
    rows.append(
        {"tokens": m, "selection": "records+protect+query", "same_kept_set": same, "device_s": round(seconds, 4)}
    )
    if not same:
        failures.append(f"{m} tokens: records+protect+query keeps another set on the device than on the CPU")
    return {"rows": rows, "failures": failures}


def synthetic_layout(m: int, seed: int = 0) -> core.Layout:
    """A prompt's layout of m one-word tokens: records of a key line and indented fields, blank lines between, the
    last line a question naming one record's key (structured selection without a tokenizer)."""
    rng = random.Random(seed)
    words = [f"w{rng.randrange(400)}" for _ in range(m)]
    for i in range(0, m - 16, 40):
        words[i] = f"\n\nrecord-{i}:"
        for j in range(i + 8, min(i + 40, m - 16), 8):
            words[j] = f"\n  field{j % 5}"
    words[m - 16] = f"\nWhich value has record-{40 * rng.randrange(max(1, (m - 16) // 40))}?"
    spans, at = [], 0
    for w in words:
        spans.append((at, at + len(w) + 1))
        at += len(w) + 1
    text = " ".join(words) + " "
    return core.Layout(text, tuple(spans), (), ((m - 16, m),))


class _no_tf32:
    """float32 matmuls in full precision on the device while comparing with the CPU."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def build(shape: Published, device: str, dtype: torch.dtype, capture: bool = False):
    """A random-weight model of `shape` built on `device` (nothing read or downloaded)."""
    from transformers import AutoModelForCausalLM  # lazy: transformers

    hf._register_capture()
    attention = hf.CAPTURE_CAUSAL if capture else "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape.llama_config(), dtype=dtype, attn_implementation=attention)
    return model.eval()


def median_time(fn: Callable[[], object], device: str, repeats: int) -> tuple[float, list[float]]:
    """Median wall time of `fn` over `repeats` runs after one warm-up (the device synchronized around each)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times
