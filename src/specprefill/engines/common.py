"""What every engine shares: prompt preparation, input checks, sampling, and the result record."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def generator(self) -> torch.Generator | None:
        if self.temperature == 0.0:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def pick_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus sampling."""
    if sampling.temperature == 0.0:
        return int(logits.argmax())
    probs = (logits.float() / sampling.temperature).softmax(-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def eos_ids_of(tokenizer, generation_eos=None) -> set[int]:
    """EOS ids from the generation config's eos_token_id (int or list) and the tokenizer (never hard-coded)."""
    ids: set[int] = set()
    eos = generation_eos
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    with model_errors(path):
        return AutoTokenizer.from_pretrained(path)


def model_context(path: str) -> int:
    """The model's context length, from its config alone."""
    from transformers import AutoConfig

    with model_errors(path):
        return int(AutoConfig.from_pretrained(path).max_position_embeddings)


@contextlib.contextmanager
def model_errors(path: str):
    """Turn a model that cannot be loaded (no such hub id, no network, broken directory) into a one-line error."""
    try:
        yield
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SpecPrefillError(
            f"cannot load model {path!r} ({first[:200]}): pass a registry name "
            "(specprefill models), a local model directory, or a hub id reachable from here"
        ) from None


def require_text(text: str) -> None:
    if not text.strip():
        raise SpecPrefillError("the prompt is empty: pass text with --prompt-file FILE (or - for stdin)")


def require_tokens(prompts) -> None:
    """Every tokenized prompt has at least one token."""
    if any(len(p) == 0 for p in prompts):
        raise SpecPrefillError("a prompt is empty: give at least one token per prompt")


def require_chat_template(tokenizer, model: str = "the model") -> None:
    """A one-line error naming the fix when a chat is asked of a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecPrefillError(
            f"{model} has no chat template: send plain prompts (no --chat / generate instead of chat), pass "
            "chat_template=..., or use a model that has one (an instruct model)"
        )


def tokenize_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Default tokenization (the tokenizer's own special tokens), or the chat template with a generation prompt."""
    require_text(text)
    if chat:
        require_chat_template(tokenizer, getattr(tokenizer, "name_or_path", None) or "the model")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    return list(tokenizer(text)["input_ids"])


def check_length(n_tokens: int, max_tokens: int, max_context: int, model: str) -> None:
    if n_tokens + max_tokens > max_context:
        raise SpecPrefillError(
            f"prompt of {n_tokens} tokens + {max_tokens} new tokens exceeds the {max_context}-token context of "
            f"{model!r}: shorten the prompt or lower --max-tokens"
        )


@dataclass
class GenerationResult:
    n_prompt_tokens: int
    prompt_token_ids: list[int]
    importance: list[float]
    kept_indices: list[int]
    output_token_ids: list[int]
    output_text: str
    config: dict
    timings: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        tokenizer,
        prompt_ids: list[int],
        kept_indices: list[int],
        importance: list[float],
        tokens: list[int],
        config: SpecPrefillConfig,
        spec_s: float,
        prefill_s: float | None,
        total_s: float,
    ) -> GenerationResult:
        return cls(
            n_prompt_tokens=len(prompt_ids),
            prompt_token_ids=list(prompt_ids),
            importance=list(importance),
            kept_indices=list(kept_indices),
            output_token_ids=tokens,
            output_text=tokenizer.decode(tokens, skip_special_tokens=True),
            config=config.to_dict(),
            timings={
                "speculation_s": spec_s,
                "base_prefill_s": prefill_s,
                "ttft_s": None if prefill_s is None else spec_s + prefill_s,
                "total_s": total_s,
            },
        )

    def to_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class Engine(Protocol):
    """What the CLI runs (`hf.HFEngine`, `vllm.adapter.VLLMEngine`): prompts in base tokens, one config each."""

    tokenizer: Any  # the base's
    last_timings: dict  # of the last `speculate`: at least "speculation_s", its wall time

    def speculate(self, prompts: Sequence[list[int]], configs: Sequence[SpecPrefillConfig]) -> list[core.PrunedPrompt]:
        """Each prompt's importance and kept tokens (no base model needed)."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 32,
        sampling: SamplingConfig | None = None,
        configs: list[SpecPrefillConfig] | None = None,
    ) -> list[GenerationResult]:
        """SpecPrefill generation of each prompt (`configs`: default the engine's own config)."""
        ...

    def answer_fits(
        self,
        prompts: Sequence[list[int]],
        answers: Sequence[list[int]],
        kept: Sequence[list[int] | None],
        restore_positions: bool = True,
    ) -> list[core.AnswerFit]:
        """Each gold answer teacher-forced after its prompt, whole (None) or on the kept indices: the paired
        fidelity measure's inputs (`core.likelihood`)."""
        ...
