"""Peak extra memory of speculation in a worker, counted with every temporary: replays the capture's calls for a
batch of prompts at a model's shapes, scheduled as vLLM schedules them (running requests decode first, prompts
prefill in chunks that fill the step's token budget), and traces every tensor allocation and free with torch's
memory profiler; the peak of live bytes is the answer.

    python scripts/capture_memory.py --model qwen2.5-coder-0.5b --length 4096 --look-ahead 8 --batch 16

q/k are random (scores do not change what is held). Prints JSON: the traced peak, and the peak the capture itself
reports (`specprefill_peak_bytes`).
"""

from __future__ import annotations

import argparse
import json


def replay(args) -> dict:
    import torch
    from transformers import AutoConfig

    from specprefill import core, models
    from specprefill.config import SpecPrefillConfig
    from specprefill.engines.vllm import capture
    from specprefill.engines.vllm.payloads import capture_payload

    cfg = AutoConfig.from_pretrained(models.resolve(args.model))
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = getattr(torch, args.dtype)
    config = SpecPrefillConfig(look_ahead=args.look_ahead)
    if hasattr(core, "AttentionRules"):
        state = capture.CaptureState([core.AttentionRules(scale=dim**-0.5)] * layers)
    else:  # the capture before per-layer rules
        state = capture.CaptureState(layers)
    module = type("Attention", (), {"num_heads": heads, "num_kv_heads": kv, "head_size": dim})()
    budget = args.step_tokens
    q_buf = torch.randn(budget, heads * dim, dtype=dtype)
    k_buf = torch.randn(budget, kv * dim, dtype=dtype)
    done = {f"r{i}": 0 for i in range(args.batch)}  # tokens fed per request
    total = args.length + args.look_ahead - 1
    from torch.profiler import ProfilerActivity, profile

    steps = 0
    tracer = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    tracer.__enter__()
    while any(v < total for v in done.values()):
        layout, row = [], 0
        decoding = [u for u, v in done.items() if args.length <= v < total]
        prefilling = [u for u, v in done.items() if v < args.length]
        for uid in decoding + prefilling:  # vLLM: running requests' decode tokens first, then prompt chunks
            fed = done[uid]
            n = 1 if fed >= args.length else min(args.length - fed, budget - row)
            if n <= 0:
                break
            layout.append((capture_payload(uid, args.length, config), row, n, fed))
            done[uid] += n
            row += n
        state.set_layout(layout)
        for layer in range(layers):
            state.on_attention(layer, module, q_buf[:row], k_buf[:row])
        steps += 1
    state.collect(list(done))
    tracer.__exit__(None, None, None)
    live = peak = 0
    for event in sorted(tracer.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage or 0
        peak = max(peak, live)
    return {
        "model": args.model,
        "shape": {"layers": layers, "heads": heads, "kv_heads": kv, "head_dim": dim, "dtype": args.dtype},
        "length": args.length,
        "look_ahead": args.look_ahead,
        "batch": args.batch,
        "step_tokens": budget,
        "steps": steps,
        "peak_extra_mib": round(peak / 2**20, 1),
        "capture_reported_peak_mib": round(state.peak_bytes / 2**20, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--look-ahead", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=8192, help="the scheduler's token budget per step")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (what held keys are stored in)")
    args = ap.parse_args()
    print(json.dumps(replay(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
