"""vLLM plugin (entry point `vllm.general_plugins`, loaded in every vLLM process): on CPU, embeddings are not packed.

vLLM 0.32's CPU path gives every vocabulary embedding a packed GEMM copy of its weight and keeps the original too
(`dispatch_cpu_unquantized_gemm(layer, remove_weight=False)`). The input embedding never uses its copy (a lookup reads
the original), and the LM head holds its matrix twice; a tied head packs the shared matrix once more. For the
Qwen2.5-Coder 1.5B checkpoint in float32 each copy is 0.87 GiB (0.51 GiB for the 0.5B). Here embeddings keep their
one weight and the LM head multiplies with it through `torch.nn.functional.linear` (the kernel vLLM itself falls back
to). Only logits rows are computed there (the last position of each request), so the head is a small share of a
step either way; measured on the fp32 Qwen pair at 4k tokens, speculation and base prefill were not slower.

`SPECPREFILL_PACK_EMBEDDINGS=1` restores vLLM's own behaviour. Linear layers are untouched (vLLM already frees their
originals after packing).
"""

from __future__ import annotations

import os

import torch

OPT_OUT = "SPECPREFILL_PACK_EMBEDDINGS"


def _unpacked(self, layer: torch.nn.Module) -> None:
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get(OPT_OUT, "") not in ("", "0"):
        return
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    UnquantizedEmbeddingMethod.process_weights_after_loading = _unpacked
