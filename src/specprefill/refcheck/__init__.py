"""The reference engine's device check, vLLM-free (`checks`: families, core; `ttft`: timing on random-weight models
of the paper's shapes; `run`: the command, its time budget and its report)."""
