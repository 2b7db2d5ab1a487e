"""SpecPrefill on vLLM: `engine` (SpecPrefillLLM, the speculator), `capture` (worker-side scoring), `positions`
(the plugin that restores original position ids), `sizing` (memory and threads), `builder` (engines from params)."""
