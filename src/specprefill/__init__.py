"""SpecPrefill: speculate important prompt tokens with a small model, prefill only those in the base model."""

from __future__ import annotations

import importlib
import os

from specprefill import quiet
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError

__all__ = [
    "PrunedPrompt",
    "SpecPrefillConfig",
    "SpecPrefillError",
    "SpecPrefillLLM",
    "EngineParams",
    "prune",
    "Pruner",
    "PrunedText",
]
__version__ = "0.1.0"

# quiet by default, as the CLI is: vLLM's INFO lines (~60 per engine pair start) only when asked for with
# VLLM_LOGGING_LEVEL=INFO. vLLM reads it when first imported (engine processes inherit it), so it is set here.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
quiet.install()  # third-party messages that say nothing here, dropped at their source (`--log-level debug` keeps them)

# imported on first use, so `import specprefill` (and the CLI's --help) loads neither torch nor vLLM
_LAZY = {
    "PrunedPrompt": "specprefill.core",
    "SpecPrefillLLM": "specprefill.engines.vllm.pair",
    "EngineParams": "specprefill.engines.vllm.builder",
    "prune": "specprefill.compress",
    "Pruner": "specprefill.compress",
    "PrunedText": "specprefill.compress",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specprefill' has no attribute {name!r}")
