"""Speculator capture inside vLLM's workers: every worker (tensor-parallel rank) scores its own heads per layer as
its attention layers run, and keeps only what the final importance needs.

`CaptureExtension` is mixed into each worker through vLLM's `worker_extension_cls`; the driver calls its methods
with `collective_rpc`. A speculated request carries `SamplingParams.extra_args[CAPTURE_KEY]` =
`{"uid": str, "n": M, "steps": N, "pool": kernel, "agg": "max" | "mean"}`; requests without it are not touched.

Per request and rank the worker holds the running `core.StepScores` ([N, M] plus counts) and, only while a later
step still needs them, the prompt keys of its own KV heads in the model dtype (freed after the last look-ahead
step; never allocated when the whole prompt is prefilled in one step and N = 1). The vLLM paged KV cache is not
read back: its layout is backend- and, on CPU, ISA-specific.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from specprefill import core
from specprefill.engines.vllm import positions

EXTENSION = "specprefill.engines.vllm.capture.CaptureExtension"


def attention_layers(model) -> list:
    """The modules whose forward receives post-RoPE q [T, H*D] and k [T, KV*D]: vLLM's `Attention` layers."""
    from vllm.model_executor.layers.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


class RequestCapture:
    """One speculated prompt on one rank."""

    def __init__(self, payload: dict, n_layers: int) -> None:
        self.m, self.steps = int(payload["n"]), int(payload["steps"])
        self.pool, self.agg = int(payload["pool"]), str(payload["agg"])
        self.n_layers = n_layers
        self.scores: core.StepScores | None = None  # on the model's device, from the first step
        self.keys: torch.Tensor | None = None  # [L, KV, M, D], only while a later step needs them

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, pos: int) -> None:
        """This request's rows of one step at one layer: q [n, H, D], k [n, KV, D], first row at position `pos`."""
        m, n = self.m, q.shape[0]
        if self.scores is None:
            self.scores = core.StepScores.empty(self.n_layers, self.steps, m, self.agg, device=q.device)
        prompt_end = min(pos + n, m)
        first, last = max(pos, m - 1), min(pos + n, m - 1 + self.steps)  # rows whose queries score the prompt
        whole_prompt_now = pos == 0 and prompt_end == m
        if pos < m and not (whole_prompt_now and self.steps == 1 and self.keys is None):
            if self.keys is None:
                self.keys = k.new_empty(self.n_layers, k.shape[1], m, k.shape[2])
            self.keys[layer, :, pos:prompt_end] = k[: prompt_end - pos].transpose(0, 1)
        if first >= last:
            return
        if self.keys is None and not whole_prompt_now:  # keys already freed (a step past the last one): nothing new
            return
        keys = self.keys[layer] if self.keys is not None else k[:m].transpose(0, 1)
        queries = q[first - pos : last - pos].transpose(0, 1)
        self.scores.add(layer, first - m + 1, core.layer_scores(queries, keys, self.pool, self.agg), q.shape[1])
        if last == m - 1 + self.steps and layer == self.n_layers - 1:
            self.keys = None  # the last look-ahead step has passed every layer

    def extra_bytes(self) -> int:
        held = self.keys.numel() * self.keys.element_size() if self.keys is not None else 0
        return held + (self.scores.reduced.numel() * 4 if self.scores is not None else 0)


class CaptureState:
    """All speculated requests of one worker; the runner patch hands it each step's layout."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.requests: dict[str, RequestCapture] = {}
        self.layout: list = []
        self.peak_bytes = 0

    def set_layout(self, layout: list) -> None:
        """`layout`: (payload, first row, rows, first position) per speculated request in this step."""
        steps = []
        for payload, row, n, pos in layout:
            uid = str(payload["uid"])
            if uid not in self.requests:
                self.requests[uid] = RequestCapture(payload, self.n_layers)
            steps.append((self.requests[uid], row, n, pos))
        self.layout = steps

    def on_attention(self, layer: int, module, q: torch.Tensor, k: torch.Tensor) -> None:
        if not self.layout:
            return
        heads, kv, dim = module.num_heads, module.num_kv_heads, module.head_size
        for req, row, n, pos in self.layout:
            req.observe(layer, q[row : row + n].view(n, heads, dim), k[row : row + n].view(n, kv, dim), pos)
        if layer == self.n_layers - 1:
            self.peak_bytes = max(self.peak_bytes, sum(r.extra_bytes() for r in self.requests.values()))

    def collect(self, uids: list[str]) -> dict:
        """Hand over (and forget) the scores of finished requests; None for a request this rank never saw."""
        out = {}
        for uid in uids:
            req = self.requests.pop(uid, None)
            out[uid] = None if req is None or req.scores is None else req.scores.to_wire()
        if not self.requests:
            self.layout = []
        return out


def _pre_hook(state: CaptureState, layer: int, module, args, kwargs) -> None:
    q = args[0] if args else kwargs["query"]
    k = args[1] if len(args) > 1 else kwargs.get("key")
    if k is not None:  # None: a layer that reuses another layer's KV cache (its heads are not scored)
        state.on_attention(layer, module, q, k)


class CaptureExtension:
    """Mixed into every vLLM worker of a speculator engine (`worker_extension_cls`)."""

    model_runner: Any  # the vLLM worker's own

    def specprefill_install(self) -> int:
        """Hook every attention layer once; returns how many were hooked (0: the model cannot be speculated)."""
        positions.register()  # the entry point normally did this already in this process
        runner = self.model_runner
        state = getattr(runner, "_specprefill_capture", None)
        if state is None:
            layers = attention_layers(runner.get_model())
            state = CaptureState(len(layers))
            for i, layer in enumerate(layers):
                layer.register_forward_pre_hook(functools.partial(_pre_hook, state, i), with_kwargs=True)
            runner._specprefill_capture = state
        return state.n_layers

    def specprefill_collect(self, uids: list[str]) -> dict:
        return self.model_runner._specprefill_capture.collect(list(uids))

    def specprefill_peak_bytes(self, reset: bool = False) -> int:
        """Peak extra memory of speculation on this rank (keys held + running scores), since the last reset."""
        state = self.model_runner._specprefill_capture
        peak = state.peak_bytes
        if reset:
            state.peak_bytes = 0
        return peak
