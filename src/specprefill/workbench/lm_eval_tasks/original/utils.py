"""Few-shot helpers of the task variants that run as the original repository's patched tasks did."""

from __future__ import annotations

from pathlib import Path


def gsm8k_exemplars() -> list[dict]:
    """The eight chain-of-thought exemplars of lm-eval's own gsm8k_cot_llama task, read from its definition."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k-cot-llama.yaml"
    return list(load_yaml(path, resolve_func=False)["fewshot_config"]["samples"])
