"""The paper's models' shapes, from their published config.json and checkpoint sizes (vLLM-free): the GPU memory plan
reads them where the hub is out of reach (`engines.vllm.gpu_plan`), and the reference engine's GPU check builds
random-weight models of these shapes (`refcheck`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    context: int
    weight_bytes: int  # the checkpoint's, as published
    checkpoint_dtype: str
    tied: bool = False  # input embeddings shared with the LM head
    rope_factor: float = 8.0  # llama3 RoPE scaling
    vocab: int = 128256

    def llama_config(self, max_positions: int | None = None):
        """A transformers `LlamaConfig` of this shape (random weights are built from it, nothing is read)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=max_positions or self.context,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": self.rope_factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=self.tied,
            bos_token_id=128000 if self.vocab > 128009 else 1,
            eos_token_id=128009 if self.vocab > 128009 else 2,
        )

    def parameters(self) -> int:
        """Parameters of this shape (embeddings once when tied)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


PUBLISHED = {
    "meta-llama/Llama-3.2-1B-Instruct": Published(
        16, 32, 8, 64, 2048, 8192, 131072, 2_470_000_000, "bfloat16", tied=True, rope_factor=32.0
    ),
    "meta-llama/Llama-3.2-3B-Instruct": Published(
        28, 24, 8, 128, 3072, 8192, 131072, 6_430_000_000, "bfloat16", tied=True, rope_factor=32.0
    ),
    "meta-llama/Llama-3.1-8B-Instruct": Published(32, 32, 8, 128, 4096, 14336, 131072, 16_060_000_000, "bfloat16"),
    "meta-llama/Llama-3.1-70B-Instruct": Published(80, 64, 8, 128, 8192, 28672, 131072, 141_100_000_000, "bfloat16"),
    # the original's 405B (neuralmagic's FP8 checkpoint): FP8 linear layers, bfloat16 embeddings and head
    "neuralmagic/Meta-Llama-3.1-405B-Instruct-FP8": Published(
        126, 128, 8, 128, 16384, 53248, 131072, 410_000_000_000, "float8"
    ),
}
