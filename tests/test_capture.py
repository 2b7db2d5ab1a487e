"""Worker-side capture, engine-free: synthetic q/k fed the way vLLM's runner feeds them (chunked prefill, decode
steps, batched requests, tensor-parallel head splits, a step after EOS) against the full-tensor reference."""

from types import SimpleNamespace

import pytest
import torch
from test_core import naive_importance, rand_qk

from specprefill import core, hardware
from specprefill.config import SpecPrefillConfig
from specprefill.engines.vllm import capture, sizing, workers
from specprefill.engines.vllm.ranks import combine_ranks, look_ahead_steps
from specprefill.engines.vllm.speculator import microbatches


def payload(uid, m, cfg, raw=False):
    from specprefill.engines.vllm.payloads import capture_payload

    return capture_payload(uid, m, cfg, raw)


def state(n_layers, rules=None):
    return capture.CaptureState(list(rules) if rules else [core.DEFAULT_RULES] * n_layers)


def feed(states, requests, chunk, extra_steps=0, raw=False):
    """Drive CaptureStates (one per rank, each owning a slice of heads) like vLLM's runner: prompts prefilled in
    chunks of `chunk` rows, then one decode row per step; all requests share each step (rows concatenated).

    requests: list of (uid, q [L,H,N,D], k [L,KV,M,D], cfg, steps_run)."""
    n_layers = requests[0][1].shape[0]
    cursor = {uid: 0 for uid, *_ in requests}
    while True:
        layout, rows_q, rows_k, row = [], [], [], 0
        for uid, q, k, cfg, steps_run in requests:
            m = k.shape[2]
            pos = cursor[uid]
            end_pos = m - 1 + steps_run + extra_steps  # positions whose tokens are fed
            if pos >= end_pos:
                continue
            n = min(chunk, m - pos) if pos < m else 1
            # row t (position p): key of prompt token p (if p < M), query of step p-M+1 (if p >= M-1), else noise
            qrows, krows = [], []
            for p in range(pos, pos + n):
                step = p - m + 1
                qrows.append(q[:, :, step] if 0 <= step < q.shape[2] else torch.randn_like(q[:, :, 0]))
                krows.append(k[:, :, p] if p < m else torch.randn_like(k[:, :, 0]))
            rows_q.append(torch.stack(qrows, 1))  # [L, n, H, D]
            rows_k.append(torch.stack(krows, 1))
            layout.append((payload(uid, m, cfg, raw), row, n, pos, None))
            cursor[uid] = pos + n
            row += n
        if not layout:
            return
        q_all, k_all = torch.cat(rows_q, 1), torch.cat(rows_k, 1)  # [L, T, H, D]
        for state, heads in states:
            state.set_layout(layout)
            kv_heads = sorted({h * k_all.shape[2] // q_all.shape[2] for h in heads})
            module = SimpleNamespace(num_heads=len(heads), num_kv_heads=len(kv_heads), head_size=q_all.shape[-1])
            for layer in range(n_layers):
                state.on_attention(
                    layer, module, q_all[layer][:, heads].flatten(1), k_all[layer][:, kv_heads].flatten(1)
                )


RULES = [(None, None, None), (0.7, 2.5, None), (None, None, 6)]


@pytest.mark.parametrize("rules", [None, RULES], ids=["default", "rules"])
@pytest.mark.parametrize("chunk", [1000, 7])
@pytest.mark.parametrize("ranks", [1, 2])
def test_worker_capture_equals_reference(chunk, ranks, rules):
    """Batched prompts of different lengths and configs, chunked prefill or not, 1 or 2 head-split ranks, default
    attention or per-layer scale / soft-cap / sliding window."""
    layer_rules = [core.AttentionRules(*r) for r in rules] if rules else None
    cfgs = [
        SpecPrefillConfig(look_ahead=4, pool_kernel=5),
        SpecPrefillConfig(look_ahead=1, layer_head_agg="mean"),
        SpecPrefillConfig(look_ahead=3, pool_kernel=0, layer_head_agg="mean", step_agg="max"),
    ]
    requests = []
    for i, (cfg, m) in enumerate(zip(cfgs, (23, 40, 9))):
        q, k = rand_qk(3, 8, 2, cfg.look_ahead, m, 8, seed=i)
        requests.append((f"r{i}", q, k, cfg, cfg.look_ahead))
    heads = list(range(8))
    splits = [heads] if ranks == 1 else [heads[:4], heads[4:]]  # rank r: query heads + their KV heads
    states = [(state(3, layer_rules), h) for h in splits]
    feed(states, requests, chunk)
    parts = [s.collect([uid for uid, *_ in requests]) for s, _ in states]
    for uid, q, k, cfg, _ in requests:
        scores = combine_ranks([p[uid] for p in parts])
        got = scores.importance(cfg.look_ahead, cfg.step_agg)
        want = torch.tensor(naive_importance(q, k, cfg, rules), dtype=torch.double)
        assert torch.allclose(got.double(), want, atol=1e-6)
        assert torch.allclose(got, core.token_importance(q, k, cfg, layer_rules), atol=1e-6)


@pytest.mark.parametrize("chunk", [1000, 7])
def test_raw_capture_keeps_every_head_as_the_reference(chunk):
    """`raw` requests: every head's weights [L, H, N, M] per request, two head-split ranks joined in rank order, equal
    to softmax(q.k * scale) over the prompt computed naively (and to `core.attention_scores`); steps past the
    generated ones are cut; importance from them equals the reduced capture's."""
    from specprefill.engines.vllm.ranks import raw_scores

    layer_rules = [core.AttentionRules(*r) for r in RULES]
    cfg = SpecPrefillConfig(look_ahead=4, pool_kernel=5)
    q, k = rand_qk(3, 8, 2, 4, 30, 8, seed=3)
    states = [(state(3, layer_rules), h) for h in (list(range(4)), list(range(4, 8)))]
    feed(states, [("a", q, k, cfg, 4)], chunk, raw=True)
    got = raw_scores([s.collect(["a"])["a"] for s, _ in states], n_generated=3, look_ahead=4)
    assert got.shape == (3, 8, 3, 30)
    want = torch.empty(3, 8, 4, 30, dtype=torch.double)
    for layer, (scale, cap, window) in enumerate(RULES):
        for h in range(8):
            logits = (q[layer, h].double() @ k[layer, h // 4].double().T) * (scale or 8**-0.5)
            if cap:
                logits = cap * torch.tanh(logits / cap)
            if window:
                pos = torch.arange(29, 33)[:, None] - torch.arange(30)[None, :]
                logits = logits.masked_fill(pos >= window, float("-inf"))
            want[layer, h] = logits.softmax(-1).nan_to_num(0.0)
    assert torch.allclose(got.double(), want[:, :, :3], atol=1e-6)
    assert torch.allclose(got, core.attention_scores(q, k, layer_rules)[:, :, :3], atol=1e-6)
    cache, three = core.ScoreCache(list(range(30)), got), SpecPrefillConfig(look_ahead=3, pool_kernel=5)
    assert torch.allclose(cache.importance(three), core.token_importance(q[:, :, :3], k, three, layer_rules), atol=1e-6)


def test_step_after_eos_is_not_counted():
    """EOS after 2 of 4 look-ahead steps; an async scheduler still runs one more step with the EOS token as input.
    The driver counts the generated tokens, so the extra query never enters the importance."""
    cfg = SpecPrefillConfig(look_ahead=4, pool_kernel=0)
    q, k = rand_qk(2, 4, 2, 4, 30, 8, seed=5)
    st = state(2)
    feed([(st, [0, 1, 2, 3])], [("r", q, k, cfg, 2)], chunk=1000, extra_steps=1)  # queries of steps 0, 1, 2
    scores = combine_ranks([st.collect(["r"])["r"]])
    assert scores.count.tolist()[:3] == [8, 8, 8]  # the extra step was captured ...
    steps = look_ahead_steps(n_generated=2, look_ahead=4)  # ... but 2 tokens were generated (the 2nd is EOS)
    got = scores.importance(steps, cfg.step_agg)
    want = core.token_importance(q[:, :, :2], k, cfg)
    assert steps == 2 and torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError):
        scores.importance(4)  # step 3 never ran


def test_recomputed_steps_are_not_counted_twice():
    """A preempted request is prefilled again; the (layer, step) pairs already in are skipped."""
    cfg = SpecPrefillConfig(look_ahead=2, layer_head_agg="mean", pool_kernel=0)
    q, k = rand_qk(2, 4, 2, 2, 12, 8, seed=6)
    once, twice = state(2), state(2)
    feed([(once, [0, 1, 2, 3])], [("r", q, k, cfg, 2)], chunk=1000)
    feed([(twice, [0, 1, 2, 3])], [("r", q, k, cfg, 2)], chunk=1000)
    feed([(twice, [0, 1, 2, 3])], [("r", q, k, cfg, 2)], chunk=1000)
    a = combine_ranks([once.collect(["r"])["r"]]).importance(2)
    b = combine_ranks([twice.collect(["r"])["r"]]).importance(2)
    assert torch.equal(a, b)


def test_keys_held_only_while_needed():
    q, k = rand_qk(2, 4, 2, 1, 50, 8, seed=7)
    one_step = state(2)  # whole prompt in one step, N = 1: scored from the step's own keys
    cfg = SpecPrefillConfig(look_ahead=1)
    feed([(one_step, [0, 1, 2, 3])], [("r", q, k, cfg, 1)], chunk=1000)
    assert one_step.requests["r"].keys == [None, None]
    # [N, M] scores + scoring's temporaries (one key head's logits, softmax, pooled copy ...)
    assert one_step.peak_bytes == 50 * 4 + core.score_temporaries(4, 2, 1, 50, 8, cfg.pool_kernel)
    q, k = rand_qk(2, 4, 2, 3, 50, 8, seed=8)
    look = state(2)
    cfg = SpecPrefillConfig(look_ahead=3)
    feed([(look, [0, 1, 2, 3])], [("r", q, k, cfg, 3)], chunk=1000)
    assert look.requests["r"].keys == [None, None]  # each layer's freed once the last step passed it
    # both layers' keys [KV, M, D] + [N, M] scores + temporaries of scoring the prefill's query
    assert look.peak_bytes == 2 * 2 * 50 * 8 * 4 + 3 * 50 * 4 + core.score_temporaries(4, 2, 1, 50, 8, 13)
    assert look.collect(["r", "unknown"])["unknown"] is None and not look.requests


def test_temporaries_are_what_scoring_allocates():
    """`score_temporaries` is an upper bound of what `layer_scores` holds at once, measured by the allocator
    (fp32 on the CPU: the peak of live tensor bytes, traced with torch's memory profiler)."""
    from torch.profiler import ProfilerActivity, profile

    heads, kv, n, m, dim = 8, 2, 3, 6000, 16
    q, k = torch.randn(heads, n, dim), torch.randn(kv, m, dim).bfloat16()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        core.layer_scores(q, k, 13, "max")
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage or 0
        peak = max(peak, live)
    # what scoring a whole layer at once held: logits, softmax and pooled [H, n, M] and fp32 keys [KV, M, D]
    whole_layer = 4 * (3 * heads * n * m + kv * m * dim)
    assert 0 < peak <= core.score_temporaries(heads, kv, n, m, dim, 13) < whole_layer


def test_wire_round_trip():
    s = core.StepScores.empty(3, 2, 5, "mean")
    s.add(1, 0, torch.rand(2, 5), heads=4)
    back = core.StepScores.from_wire(s.to_wire())
    assert torch.equal(back.reduced, s.reduced) and torch.equal(back.count, s.count) and torch.equal(back.done, s.done)


def test_no_capture_for_unknown_rank_is_an_error():
    from specprefill.errors import SpecPrefillError

    with pytest.raises(SpecPrefillError, match="enforce_eager"):
        combine_ranks([None, None])


@pytest.mark.parametrize(
    "lengths,budget,want",
    [
        ([10, 10, 10], 25, [[0, 1], [2]]),
        ([30, 5, 5], 25, [[0], [1, 2]]),
        ([5], 1, [[0]]),
        ([], 10, []),
    ],
)
def test_microbatches(lengths, budget, want):
    assert microbatches(lengths, budget) == want


# ---------------------------------------------------------------- sizing and hardware


@pytest.mark.parametrize(
    "flags,want",
    [
        ({"avx2", "fma"}, "float32"),
        ({"avx2", "avx512f", "avx512_vnni"}, "float32"),
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),
        (set(), "float32"),
    ],
)
def test_auto_dtype_follows_cpu_flags(flags, want):
    assert hardware.auto_dtype(flags, cuda=False) == want
    assert hardware.resolve_dtype("auto", flags, cuda=False) == want
    assert hardware.resolve_dtype(None, flags, cuda=False) == want
    assert hardware.resolve_dtype("float16", flags, cuda=False) == "float16"  # explicit wins
    assert hardware.auto_dtype(flags, cuda=True) == "auto"  # GPUs: vLLM picks


def test_unknown_dtype_is_one_line_error():
    from specprefill.errors import SpecPrefillError

    with pytest.raises(SpecPrefillError, match="use one of auto, float32"):
        hardware.resolve_dtype("fp8")


@pytest.mark.parametrize(
    "ranks,cpus,want",
    [(1, [0, 1], "0-1"), (2, [0, 1], "0|1"), (2, [0, 1, 2, 3], "0-1|2-3"), (2, [0, 2, 4, 6], "0,2|4,6"), (1, [3], "3")],
)
def test_threads_bind(ranks, cpus, want):
    assert hardware.threads_bind(ranks, cpus) == want


def test_threads_bind_needs_a_core_per_rank():
    from specprefill.errors import SpecPrefillError

    with pytest.raises(SpecPrefillError, match="lower the tensor parallel size"):
        hardware.threads_bind(4, [0, 1])


def test_machine_record_names_cpu_and_dtype():
    m = hardware.machine()
    assert m["cpu_model"] and m["auto_dtype"] in ("float32", "bfloat16", "auto") and isinstance(m["cpu_flags"], list)


def test_cpu_plan_sizes_each_engine_from_its_shape(smollm2, monkeypatch):
    monkeypatch.setattr(sizing, "is_cpu", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    base, spec = sizing.plan(
        smollm2,
        smollm2,
        {"dtype": "float32", "max_model_len": 1000},
        {"dtype": "bfloat16", "max_model_len": 1000, "kv_cache_memory_bytes": 123},
        3,
    )
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32
    assert base["kv_cache_memory_bytes"] == per_token * (1000 + sizing.KV_SLACK_TOKENS) * 3
    assert spec["kv_cache_memory_bytes"] == 123  # explicit wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own variable wins over the plan
    base, _ = sizing.plan(smollm2, smollm2, {"dtype": "float32"}, {}, 3)
    assert "kv_cache_memory_bytes" not in base


def test_gpu_plan_splits_memory_by_weights(smollm2, tiny_model, monkeypatch):
    from specprefill.errors import SpecPrefillError

    monkeypatch.setattr(sizing, "is_cpu", lambda: False)
    base, spec = sizing.plan(smollm2, tiny_model, {}, {})
    wb, ws = sizing.model_shape(smollm2).weight_bytes, sizing.model_shape(tiny_model).weight_bytes
    assert spec["gpu_memory_utilization"] == pytest.approx(max(0.05, 0.9 * ws / (wb + ws)), abs=1e-3)
    assert base["gpu_memory_utilization"] + spec["gpu_memory_utilization"] == pytest.approx(0.9)
    base, spec = sizing.plan(smollm2, tiny_model, {"gpu_memory_utilization": 0.7}, {})
    assert spec["gpu_memory_utilization"] == pytest.approx(0.2)
    with pytest.raises(SpecPrefillError, match="lower one of them"):
        sizing.plan(smollm2, tiny_model, {"gpu_memory_utilization": 0.95}, {})


def test_raw_capture_refuses_a_layer_it_never_saw():
    """A layer whose attention never ran through the hooks (one that reuses another layer's KV cache) is refused,
    not filled with zeros that would dilute importance."""
    from specprefill.engines.vllm.ranks import raw_scores
    from specprefill.errors import SpecPrefillError

    part = {"raw": torch.zeros(2, 1, 1, 3).numpy().tobytes(), "shape": [2, 1, 1, 3], "done": [[True], [False]]}
    with pytest.raises(SpecPrefillError, match=r"layer\(s\) \[1\].*engine hf"):
        raw_scores([part], n_generated=1, look_ahead=1)
    part["done"] = [[True], [True]]
    assert raw_scores([part], n_generated=1, look_ahead=1).shape == (2, 1, 1, 3)


def test_rewrite_batch_writes_only_pruned_rows_and_refuses_a_buffer_it_does_not_know():
    """One step of three requests (plain, pruned mid-prompt, pruned decoding): only the pruned rows change, to the
    positions `prune` gives; kept indices are cached per request on the host; a buffer that does not hold the cache
    positions (another vLLM's layout) is refused, not rewritten."""
    import numpy as np

    from specprefill.engines.vllm import positions

    pruned = core.prune(list(range(40)), torch.tensor([1, 5, 6, 30, 39]), SpecPrefillConfig())
    payload = {positions.POSITIONS_KEY: {"kept": pruned.kept_indices, "n": 40}}
    extras = {"plain": None, "chunk": payload, "decode": payload}
    num_scheduled, starts = np.array([3, 3, 1]), np.array([10, 3, 7])  # chunk: cache 3, 4 (prompt), 5 (generated)
    buffer = torch.tensor([10, 11, 12, 3, 4, 5, 7])
    cache: dict = {}
    positions.rewrite_batch(["plain", "chunk", "decode"], num_scheduled, starts, buffer, extras.get, cache)
    assert buffer.tolist() == [10, 11, 12, 30, 39, 40, 42]
    assert set(cache) == {"chunk", "decode"} and cache["chunk"].device.type == "cpu"
    with pytest.raises(RuntimeError, match="not supported"):
        positions.rewrite_batch(["chunk"], np.array([2]), np.array([0]), torch.tensor([5, 6]), extras.get, {})


@pytest.mark.parametrize("layout", ["rows", "transposed", "pairs"])
def test_cache_layout_is_learned_from_the_backends_own_writer(layout):
    """`CacheLayout` learns where a paged cache keeps each key from the layer's cache writer alone: for a cache that
    stores keys row-major, transposed within a block, or packed in pairs of dimensions, the keys read back for a
    request's blocks are the keys written (values never read as keys)."""
    blocks, kv, size, dim = 6, 2, 32, 8

    def place(key_block):  # [size, kv, dim] -> the block's key half [kv, size * dim] in this layout
        if layout == "rows":
            return key_block.transpose(0, 1).reshape(kv, -1)
        if layout == "transposed":
            return key_block.permute(1, 2, 0).reshape(kv, -1)
        return key_block.view(size // 2, 2, kv, dim // 2, 2).permute(2, 0, 3, 1, 4).reshape(kv, -1)

    def writer(module, key, value, cache, slots):
        for b in sorted({int(s) // size for s in slots}):
            sel = [i for i, s in enumerate(slots.tolist()) if s // size == b]
            block = torch.zeros(size, kv, dim, dtype=cache.dtype)
            block[[slots[i] % size for i in sel]] = key[sel].to(cache.dtype)
            cache[b, :, : size * dim] = place(block)
            cache[b, :, size * dim :] = value[sel].transpose(0, 1).reshape(kv, -1).to(cache.dtype)

    cache = torch.zeros(blocks, kv, 2 * size * dim, dtype=torch.bfloat16)
    module = SimpleNamespace(kv_cache=cache, num_kv_heads=kv, head_size=dim, kv_cache_dtype="auto")
    module.impl = SimpleNamespace(do_kv_cache_update=writer)
    keys = torch.randn(3 * size, kv, dim).to(torch.bfloat16)
    table = [4, 1, 3]
    slots = torch.tensor([table[t // size] * size + t % size for t in range(3 * size)])
    writer(module, keys, torch.full_like(keys, 7), cache, slots)
    got = capture.CacheLayout.probe(module, blocks).keys(cache, table, 70)
    assert torch.equal(got, keys[:70].transpose(0, 1))
    module.kv_cache_dtype = "fp8"
    with pytest.raises(RuntimeError, match="quantized"):
        capture.CacheLayout.probe(module, blocks)


def test_a_kv_cache_that_cannot_be_read_back_is_refused_when_the_speculator_starts(monkeypatch):
    """With prefix caching the speculator reads cached keys back from its paged KV cache; a cache it cannot read (a
    quantized one) is refused at start (`specprefill_install`, which the builder turns into a one-line error), not at
    the first cache hit inside a forward, where it would end the engine."""

    class Layer(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.kv_cache = torch.zeros(6, 2, 2 * 32 * 8)
            self.num_kv_heads, self.head_size, self.num_heads, self.kv_cache_dtype = 2, 8, 4, dtype
            self.impl = SimpleNamespace(do_kv_cache_update=lambda *a: None, scale=0.3, logits_soft_cap=None)
            self.sliding_window = None

    def install(dtype):
        layer = Layer(dtype)
        monkeypatch.setattr(capture, "attention_layers", lambda model: [layer])
        monkeypatch.setattr(workers, "register", lambda: None)
        monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
        runner = SimpleNamespace(
            get_model=lambda: None,
            cache_config=SimpleNamespace(enable_prefix_caching=True),
            kv_cache_config=SimpleNamespace(kv_cache_groups=[0], num_blocks=6),
        )
        worker = workers.CaptureExtension()
        worker.model_runner = runner
        return worker.specprefill_install()

    refused = install("fp8")["refusal"]
    assert "cannot be read back" in refused and "quantized" in refused and "enable_prefix_caching=false" in refused
