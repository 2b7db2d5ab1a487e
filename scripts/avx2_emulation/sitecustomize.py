"""Run any Python of the project as an AVX2-only x86 CPU would (no AVX-512, no AMX, no native bf16).

    PYTHONPATH=scripts/avx2_emulation specprefill bench prefill ...      # or make reproduce, pytest, ...

Every Python process started with this on its path (engine cores, papermill kernels included) caps oneDNN, MKL and
ATen at AVX2, makes vLLM load its AVX2 kernels, and tells specprefill the CPU has the AVX2 machine's flags (so
`dtype="auto"` picks float32 and results record the emulated flags). An estimate of an AVX2 machine's times on a
faster core, not a measurement of one.

Known to differ from a real AVX2 machine: vLLM's tensor parallel on CPU fails under it on an AVX-512 host (a worker's
vocab-parallel embedding raises "index out of range", plain `vllm.LLM(tensor_parallel_size=2)` too, checked
2026-11-26 with ATEN_CPU_CAPABILITY=avx2 alone), while it runs on AVX2-only EPYCs and natively here.
"""
import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
os.environ.setdefault("SPECPREFILL_CPU_FLAGS", "avx2 fma sse4_2 f16c bmi2")

# torch's own CPU feature answers, patched when a program imports torch (not before: a process that never uses
# torch, such as `specprefill --help`, must not load it because of this file)
import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402

_NO = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")


class _AVX2Only(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)  # once, and not while looking the module up
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for feature in _NO:
                setattr(module, feature, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AVX2Only())
