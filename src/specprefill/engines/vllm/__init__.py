"""SpecPrefill on vLLM: `pair` (SpecPrefillLLM), `speculator` (VLLMSpeculator), `requests` (what the offline and
async engines share per request), `async_engine` (the server's engine), `adapter` (VLLMEngine, the CLI's
`common.Engine`), `capture` (worker-side scoring), `positions` (the plugin that restores original position ids),
`sizing` (memory and threads), `builder` (engines from params)."""
