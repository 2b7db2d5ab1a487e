"""Run any Python of the project as an AVX2-only x86 CPU would (no AVX-512, no AMX, no native bf16).

    PYTHONPATH=scripts/avx2_emulation specprefill bench prefill ...      # or make reproduce, pytest, ...

Every Python process started with this on its path (engine cores, papermill kernels included) caps oneDNN, MKL and
ATen at AVX2, makes vLLM load its AVX2 kernels, and tells specprefill the CPU has the AVX2 machine's flags (so
`dtype="auto"` picks float32 and results record the emulated flags). An estimate of an AVX2 machine's times on a
faster core, not a measurement of one.
"""
import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
os.environ.setdefault("SPECPREFILL_CPU_FLAGS", "avx2 fma sse4_2 f16c bmi2")

import torch.cpu  # noqa: E402  (after the ISA caps, which torch reads at load)

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
