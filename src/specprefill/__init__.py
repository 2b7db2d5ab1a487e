"""SpecPrefill: speculate important prompt tokens with a small model, prefill only those in the base model."""
from specprefill.core import PrunedPrompt, SpecPrefillConfig
from specprefill.errors import SpecPrefillError

__all__ = ["PrunedPrompt", "SpecPrefillConfig", "SpecPrefillError", "SpecPrefillLLM", "EngineParams"]
__version__ = "0.1.0"

_LAZY = {"SpecPrefillLLM": "specprefill.engines.vllm.engine", "EngineParams": "specprefill.engines.vllm.builder"}


def __getattr__(name: str):
    """`from specprefill import SpecPrefillLLM` without importing vLLM's engine code for everything else."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specprefill' has no attribute {name!r}")
