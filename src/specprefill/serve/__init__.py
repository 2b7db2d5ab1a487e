"""Serving: `specprefill serve`, an OpenAI-compatible SpecPrefill server on vLLM's async engine (`server.serve`)."""
