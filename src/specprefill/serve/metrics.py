"""SpecPrefill's Prometheus metrics, served by vLLM's `/metrics` beside its own (same default registry)."""

from __future__ import annotations


class ServerMetrics:
    _instance: ServerMetrics | None = None

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.requests = Counter("specprefill_requests", "Requests seen, by whether the prompt was pruned", ["pruned"])
        self.prompt_tokens = Counter("specprefill_prompt_tokens", "Prompt tokens of all requests (M)")
        self.kept_tokens = Counter("specprefill_kept_tokens", "Prompt tokens the base prefilled (K)")
        self.background_tokens = Counter(
            "specprefill_background_tokens", "Tokens sent to the base by background prefills (prompt and answer whole)"
        )
        self.background_seconds = Counter("specprefill_background_seconds", "Seconds background prefills ran")
        self.background_runs = Counter(
            "specprefill_background_prefills", "Background prefills, by how they ended", ["outcome"]
        )
        self.speculation_seconds = Histogram(
            "specprefill_speculation_seconds",
            "Speculation time per pruned request",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120),
        )

    @classmethod
    def get(cls) -> ServerMetrics:
        """One set per process (a registry refuses a metric name twice)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def observe(self, record) -> None:
        pruned = record.n_kept_tokens < record.n_prompt_tokens or record.keep_rate < 1
        self.requests.labels(pruned=str(pruned).lower()).inc()
        self.prompt_tokens.inc(record.n_prompt_tokens)
        self.kept_tokens.inc(record.n_kept_tokens)
        if pruned:
            self.speculation_seconds.observe(record.speculation_ms / 1000)

    def background(self, tokens: int, seconds: float, outcome: str) -> None:
        """One background prefill ended: "finished", "cancelled" (a request arrived), "failed", or "dropped" (given up
        waiting: over its tenant's token budget or the queue's length)."""
        self.background_tokens.inc(tokens)
        self.background_seconds.inc(seconds)
        self.background_runs.labels(outcome=outcome).inc()
