"""SpecPrefill: speculate important prompt tokens with a small model, prefill only those in the base model."""
from specprefill.core import PrunedPrompt, SpecPrefillConfig
from specprefill.errors import SpecPrefillError

__all__ = ["PrunedPrompt", "SpecPrefillConfig", "SpecPrefillError"]
__version__ = "0.1.0"
