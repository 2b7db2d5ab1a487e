"""Speculator capture inside vLLM's workers: every worker (tensor-parallel rank) scores its own heads per layer as
its attention layers run, under each layer's own attention rules, and keeps only what the final importance needs.

`workers.CaptureExtension` is mixed into each worker through vLLM's `worker_extension_cls`; the driver calls its
methods with `collective_rpc`. A speculated request carries `SamplingParams.extra_args[CAPTURE_KEY]` =
`{"uid": str, "n": M, "steps": N, "pool": kernel, "agg": "max" | "mean"}` (plus `"raw": True` to keep every head's
weights unreduced instead); requests without it are not touched.

Per request and rank the worker holds the running `core.StepScores` ([N, M] plus counts) and, only while a later
step still needs them, each layer's prompt keys of its own KV heads in the model dtype: a layer's keys are freed as
soon as the last look-ahead step has passed that layer, and never allocated when the whole prompt is prefilled in
one step and N = 1. Scoring itself holds one key head's logits at a time (`core.layer_scores`). The vLLM paged KV
cache is read back only for a prompt whose first tokens came from the prefix cache (their keys never pass the
hooks), at positions learned from the backend's own cache writer (`CacheLayout`: the layout is backend- and, on CPU,
ISA-specific). Nothing here waits for the device: the layout (rows and first positions) comes from the host side of
the runner.
"""

from __future__ import annotations

import torch

from specprefill import core

# of the memory free once both engines are profiled, the share speculation may hold at once (`budgets.fit_budget`)
FREE_MEMORY_SHARE = 0.5


def attention_layers(model) -> list:
    """The modules whose forward receives post-RoPE q [T, H*D] and k [T, KV*D]: vLLM's `Attention` layers."""
    from vllm.model_executor.layers.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def layer_rules(module) -> core.AttentionRules:
    """The layer's own scale, logit soft-cap and sliding window, as its attention kernel applies them."""
    impl = module.impl
    return core.AttentionRules.of(impl.scale, getattr(impl, "logits_soft_cap", None), module.sliding_window)


def attention_refusal(layers: list) -> str | None:
    """Why attention weights computed from q and k alone would not be the model's, or None."""
    for module in layers:
        if getattr(module.impl, "alibi_slopes", None) is not None:
            return "it uses ALiBi (position biases instead of position ids), which SpecPrefill does not support"
        if getattr(module, "has_sink", False):
            return "its attention has sink logits, which scoring from q and k alone would leave out"
    return None


def model_refusal(worker) -> str | None:
    """`attention_refusal` of a worker's model (any worker answers `collective_rpc("specprefill_refusal")`)."""
    return attention_refusal(attention_layers(worker.model_runner.get_model()))


class CacheLayout:
    """Where a layer's paged KV cache keeps each key, learned from the layer's own cache writer: the attention
    backend's `do_kv_cache_update` (the same op and ISA the model's forward uses) writes known keys into a scratch
    copy of two blocks, and the positions they land at are read back. Backend- and ISA-independent (the CPU kernels
    store keys transposed or packed per ISA); refused when the cache is quantized or the writer is missing.

    `index[t, h, d]`: the element of one block (the block dimension moved first, the rest flattened) holding key
    dimension d of KV head h of the block's token t."""

    DIGIT = 16  # keys are written as base-16 digits + 1: exact in every float dtype

    def __init__(self, block_dim: int, index: torch.Tensor) -> None:
        self.block_dim, self.index = block_dim, index
        self.block_size, self.kv_heads, self.head_size = index.shape

    @classmethod
    def probe(cls, module, n_blocks: int) -> CacheLayout:
        cache = module.kv_cache
        if getattr(module, "kv_cache_dtype", "auto") != "auto":
            raise RuntimeError(f"a quantized KV cache ({module.kv_cache_dtype}) cannot be read back exactly")
        writer = getattr(module.impl, "do_kv_cache_update", None)
        dims = [i for i, size in enumerate(cache.shape) if size == n_blocks]
        if writer is None or len(dims) != 1:
            raise RuntimeError("the attention backend's KV cache has no block dimension or cache writer to read")
        block_dim = dims[0]
        scratch = torch.zeros_like(cache.narrow(block_dim, 0, 2))
        kv, dim = module.num_kv_heads, module.head_size
        per_block = scratch.select(block_dim, 0).numel()  # keys and values of one block
        if per_block % (2 * kv * dim):
            raise RuntimeError("the KV cache's blocks are not keys and values of whole tokens")
        block_size = per_block // (2 * kv * dim)
        ids = torch.arange(block_size * kv * dim).view(block_size, kv, dim)
        found = torch.zeros(per_block, dtype=torch.int64)
        slots = torch.arange(block_size, 2 * block_size, device=cache.device)  # block 1 of the scratch copy
        value = torch.zeros(block_size, kv, dim, dtype=cache.dtype, device=cache.device)
        written = None
        n_digits, scale = 1, cls.DIGIT
        while scale < ids.numel():
            n_digits, scale = n_digits + 1, scale * cls.DIGIT
        for j in range(n_digits):
            digit = (ids // cls.DIGIT**j) % cls.DIGIT
            scratch.zero_()
            writer(module, (digit + 1).to(cache.dtype).to(cache.device), value, scratch, slots)
            got = scratch.movedim(block_dim, 0)[1].reshape(-1).float().cpu()
            where = got > 0
            written = where if written is None else written
            if not torch.equal(where, written):
                raise RuntimeError("the KV cache layout changed between writes")
            found[where] += (got[where].round().long() - 1) * cls.DIGIT**j
        assert written is not None
        positions = torch.nonzero(written).flatten()
        if positions.numel() != ids.numel() or not torch.equal(torch.sort(found[positions]).values, ids.flatten()):
            raise RuntimeError("the KV cache does not hold each key element once")
        index = torch.empty(ids.numel(), dtype=torch.int64)
        index[found[positions]] = positions
        return cls(block_dim, index.view(block_size, kv, dim).to(cache.device))

    def keys(self, cache: torch.Tensor, block_ids, count: int) -> torch.Tensor:
        """Post-RoPE keys [KV, count, D] of a request's first `count` tokens, from its blocks `block_ids`."""
        n = -(-count // self.block_size)
        blocks = torch.as_tensor(list(block_ids[:n]), dtype=torch.int64, device=cache.device)
        flat = cache.movedim(self.block_dim, 0)[blocks].reshape(n, -1)
        keys = flat[:, self.index.flatten()].view(n * self.block_size, self.kv_heads, self.head_size)
        return keys[:count].transpose(0, 1)


class RequestCapture:
    """One speculated prompt on one rank."""

    def __init__(self, payload: dict, n_layers: int, first_head: int = 0) -> None:
        self.m, self.steps = int(payload["n"]), int(payload["steps"])
        self.pool, self.agg = int(payload["pool"]), str(payload["agg"])
        self.n_layers = n_layers
        # the scored heads: layer -> global query heads (None: all); this rank's heads start at `first_head`
        self.heads = None if payload.get("heads") is None else {int(la): h for la, h in payload["heads"]}
        self.first_head = first_head
        self.scores: core.StepScores | None = None  # on the model's device, from the first step
        # "raw" requests keep every head's weights [H, N, M] per layer, unreduced (the explorer, per-layer agreement)
        self.raw: list[torch.Tensor | None] | None = [None] * n_layers if payload.get("raw") else None
        self.keys: list[torch.Tensor | None] = [None] * n_layers  # [KV, M, D] per layer, while a later step needs it
        self.held_bytes = 0  # of `keys`, kept as they are allocated and freed (read once per layer call)

    def observe(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, pos: int, rules: core.AttentionRules, cached=None
    ) -> int:
        """This request's rows of one step at one layer: q [n, H, D], k [n, KV, D], first row at cache position
        `pos`; `cached(pos)`: the keys [KV, pos, D] of the tokens before `pos` that vLLM's prefix cache supplied (the
        request's first step starts after them). Returns the bytes scoring held temporarily (0: nothing scored)."""
        m, n = self.m, q.shape[0]
        if self.scores is None:
            self.scores = core.StepScores.empty(self.n_layers, self.steps, m, self.agg, device=q.device)
        local: list[int] | None = None  # this rank's scored heads at this layer (None: all of them)
        if self.heads is not None:
            if layer not in self.heads:
                return 0  # an unscored layer: its keys are never held
            wanted = self.heads[layer]
            if wanted is not None:
                local = [h - self.first_head for h in wanted if 0 <= h - self.first_head < q.shape[1]]
                if not local:
                    return 0  # its heads live on other ranks
        prompt_end = min(pos + n, m)
        first, last = max(pos, m - 1), min(pos + n, m - 1 + self.steps)  # rows whose queries score the prompt
        whole_prompt_now = pos == 0 and prompt_end == m
        if pos < m and not (whole_prompt_now and self.steps == 1):
            if self.keys[layer] is None:
                self.keys[layer] = k.new_empty(k.shape[1], m, k.shape[2])
                self.held_bytes += k.shape[1] * m * k.shape[2] * k.element_size()
                if pos > 0:  # the request's first step here: its first `pos` tokens came from the prefix cache
                    if cached is None:
                        raise RuntimeError("specprefill: a speculated prompt started from the prefix cache unread")
                    self.keys[layer][:, :pos] = cached(pos)  # type: ignore[index]
            self.keys[layer][:, pos:prompt_end] = k[: prompt_end - pos].transpose(0, 1)  # type: ignore[index]
        if first >= last:
            return 0
        held = self.keys[layer]
        if held is None and not whole_prompt_now:  # keys already freed (a step past the last one): nothing new
            return 0
        keys = held if held is not None else k[:m].transpose(0, 1)
        queries = q[first - pos : last - pos].transpose(0, 1)
        if self.raw is not None:
            if self.raw[layer] is None:
                self.raw[layer] = q.new_zeros(q.shape[1], self.steps, m, dtype=torch.float32)
            self.raw[layer][:, first - m + 1 : last - m + 1] = core.head_scores(queries, keys, rules, first)  # type: ignore[index]
            self.scores.done[layer, first - m + 1 : last - m + 1] = True
        else:
            self.scores.add(
                layer,
                first - m + 1,
                core.layer_scores(queries, keys, self.pool, self.agg, rules, first, local),
                q.shape[1] if local is None else len(local),
            )
        if last == m - 1 + self.steps and held is not None:
            self.held_bytes -= held.numel() * held.element_size()
            self.keys[layer] = None  # the last look-ahead step has passed this layer
        return core.score_temporaries(q.shape[1], k.shape[1], last - first, m, q.shape[2], self.pool)

    def extra_bytes(self) -> int:
        raw = sum(r.numel() * 4 for r in self.raw if r is not None) if self.raw is not None else 0
        return self.held_bytes + raw + (self.scores.reduced.numel() * 4 if self.scores is not None else 0)

    def to_wire(self) -> dict | None:
        if self.scores is None:
            return None
        if self.raw is None:
            return self.scores.to_wire()
        heads = next((r.shape[0] for r in self.raw if r is not None), 0)
        raw = torch.stack(
            [r if r is not None else self.scores.reduced.new_zeros(heads, self.steps, self.m) for r in self.raw]
        )
        return {
            "raw": raw.cpu().contiguous().numpy().tobytes(),
            "shape": list(raw.shape),
            "done": self.scores.done.tolist(),  # which (layer, step) this rank observed
        }


class CaptureState:
    """All speculated requests of one worker; the runner patch hands it each step's layout."""

    def __init__(self, rules: list[core.AttentionRules], rank: int = 0) -> None:
        self.rules = rules
        self.rank = rank  # tensor-parallel rank: query heads are split over the ranks in rank order
        self.local_heads = 0  # query heads per rank (set at install)
        self.n_layers = len(rules)
        self.requests: dict[str, RequestCapture] = {}
        self.layout: list = []
        self.peak_bytes = 0
        self.n_blocks = 0  # of the KV cache (set at install when prefix caching is on)
        self.cache_layout: CacheLayout | None = None  # learned at install (prefix caching on)

    def set_layout(self, layout: list) -> None:
        """`layout`: (payload, first row, rows, first position, the request's block ids or a function giving them)
        per speculated request in this step; [] for a step with none (and for dummy runs)."""
        steps = []
        for payload, row, n, pos, blocks in layout:
            uid = str(payload["uid"])
            if uid not in self.requests:
                self.requests[uid] = RequestCapture(payload, self.n_layers, self.rank * self.local_heads)
            steps.append((self.requests[uid], row, n, pos, blocks))
        self.layout = steps

    def cached_keys(self, module, blocks):
        """The reader of one request's cached keys at one layer (`RequestCapture.observe`'s `cached`)."""

        def read(count: int) -> torch.Tensor:
            if self.cache_layout is None:
                self.cache_layout = CacheLayout.probe(module, self.n_blocks)
            ids = blocks() if callable(blocks) else blocks
            return self.cache_layout.keys(module.kv_cache, ids, count)

        return read

    def on_attention(self, layer: int, module, q: torch.Tensor, k: torch.Tensor) -> None:
        if not self.layout:
            return
        heads, kv, dim = module.num_heads, module.num_kv_heads, module.head_size
        rules = self.rules[layer]
        temporaries = 0
        for req, row, n, pos, blocks in self.layout:
            cached = self.cached_keys(module, blocks) if pos > 0 else None
            used = req.observe(
                layer, q[row : row + n].view(n, heads, dim), k[row : row + n].view(n, kv, dim), pos, rules, cached
            )
            temporaries = max(temporaries, used)  # one request is scored at a time
        held = sum(r.extra_bytes() for r in self.requests.values())
        self.peak_bytes = max(self.peak_bytes, held + temporaries)

    def collect(self, uids: list[str]) -> dict:
        """Hand over (and forget) the scores of finished requests; None for a request this rank never saw."""
        out = {}
        for uid in uids:
            req = self.requests.pop(uid, None)
            out[uid] = None if req is None else req.to_wire()
        if not self.requests:
            self.layout = []
        return out


def pre_hook(state: CaptureState, layer: int, module, args, kwargs) -> None:
    q = args[0] if args else kwargs["query"]
    k = args[1] if len(args) > 1 else kwargs.get("key")
    if k is not None:  # None: a layer that reuses another layer's KV cache (its heads are not scored)
        state.on_attention(layer, module, q, k)


def free_bytes(device: torch.device) -> int:
    """Memory free now on the worker's device (GPU: the device's; CPU: the machine's available RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)
