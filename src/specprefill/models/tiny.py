"""Tiny random-weight checkpoints built where they are used (the tests, the reference engine's GPU check; nothing is
downloaded): one per decoder family whose attention rules differ, all with the same 64-word word-level tokenizer
(w0 ... w60, <s>, </s>, <unk>)."""

from __future__ import annotations

from typing import Any

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
COMMON: dict[str, Any] = {
    "vocab_size": len(WORDS),
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the smallest head vLLM's CPU attention takes
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# family: (transformers config class, model class, what sets its attention apart), windows far below the prompts
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # q/k RMS norm
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {  # query scalar != head_dim, strong logit soft-cap, sliding and global layers alternating
            "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 30.0,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "tie_word_embeddings": True,
        },
    ),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv and gate/up projections
}


def save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    ).save_pretrained(path)


def tiny_checkpoint(path, family: str, seed: int = 0, scale_qk: float = 3.0) -> str:
    """A random checkpoint of `family` under `path`, fp32. Query/key projections are scaled up so attention is
    sharp (token scores differ clearly, and soft-caps and scales change which tokens win)."""
    import torch
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                param.mul_(scale_qk)
            if name.endswith("lm_head.weight") or (family == "gemma2" and name.endswith("embed_tokens.weight")):
                param.mul_(4.0)  # logits far apart: greedy tokens are not near-ties
    save_tokenizer(path)
    model.save_pretrained(path)
    return str(path)
