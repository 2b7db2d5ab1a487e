"""SpecPrefill on vLLM: `pair` (SpecPrefillLLM, offline), `async_engine` (the server's engine client), `request` (one
request's plan, the same for both), `speculator` and `async_speculator` (the speculator engines), `payloads` (what
a request carries to each engine), `adapter` (VLLMEngine, the CLI's `common.Engine`), `capture` (worker-side
scoring), `positions` (original position ids in the runners), `workers` (the plugin's entry point, the workers'
RPCs and extension), `sizing` (memory and threads), `builder` (engines from params)."""
