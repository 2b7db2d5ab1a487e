"""Third-party messages that say nothing to a user of this project, dropped where they are made: each is named by its
logger and a piece of its text, so nothing else from the same logger is lost. `--log-level debug` (or
`install(debug=True)`) keeps them all. Imported by `specprefill/__init__.py` before vLLM or torch, so it also holds in
the processes vLLM starts (they import the script or the command that imports this package first)."""

from __future__ import annotations

import builtins
import logging
import os
import re
import warnings

# (logger, text): why it is noise here
NOISE = (
    # vLLM's CPU build checks for Triton's CPU backend at import; the PyPI Triton has none and vLLM runs without it
    ("vllm.triton_utils.importing", "doesn't include CPU backend"),
    # an engine's worker processes took longer than vLLM's grace period to exit at shutdown; they are killed, as asked
    ("vllm.v1.utils", "force killing remaining processes"),
    # a second engine in one process asks torch for its thread count again (the threads are already bound)
    ("vllm.v1.worker.cpu_worker", "torch.set_num_threads"),
    # ... and re-registers vLLM's kernels
    ("vllm.triton_utils.dispatcher", "is already registered"),
    # the project runs CPU engines (and every speculator) eager on purpose, on vLLM's V1 runner (V2 needs Triton)
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    ("vllm.platforms.cpu", "triton-cpu is expected on x86 CPUs"),
    # allocator advice (tcmalloc / Intel OpenMP in LD_PRELOAD); the project's numbers are measured without them
    ("vllm.v1.worker.cpu_worker", "is not found in LD_PRELOAD"),
    # the project sets each engine's threads itself
    ("vllm.utils.torch_utils", "leaving Torch threads at"),
    # a one-prompt CLI run keeps vLLM's engine in its own process on purpose (`cli.run.in_process_vllm`), seeded
    ("vllm.engine.arg_utils", "The global random seed is set to"),
)
# Python warnings, by the start of their text and their category: vLLM's kernel dispatcher looks at every attribute
# of torch.distributed, one of which is deprecated; vLLM's tensor-parallel workers gather with a deprecated call
WARNINGS = (
    ("`torch.distributed.reduce_op` is deprecated", "FutureWarning"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "FutureWarning"),
)


class _Drop(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def install(debug: bool = False) -> None:
    """Drop the `NOISE` messages (all of them shown again with `debug=True`); torch's C++ warnings (e.g. vLLM's
    NUMA memory-binding notice in every CPU worker) only from errors up unless the user set TORCH_CPP_LOG_LEVEL,
    read by torch when it loads, so for this process's children too."""
    for name in {name for name, _ in NOISE}:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _Drop)]:
            logger.removeFilter(old)
    for name, text in NOISE if not debug else ():
        logging.getLogger(name).addFilter(_Drop(text))
    _cpp_level("WARNING" if debug else "ERROR")  # WARNING: torch's own default
    _warnings(debug)


_CPP_LEVEL = "TORCH_CPP_LOG_LEVEL"
_cpp_level_set: list[str] = []  # the value this process last gave it (a value found there is the user's)


def _cpp_level(level: str) -> None:
    """torch's C++ log level, unless the user chose one: a value this process set itself is replaced (so debug and
    back restores the quiet level), any other is kept."""
    current = os.environ.get(_CPP_LEVEL)
    if current is not None and current not in _cpp_level_set[-1:]:
        return
    os.environ[_CPP_LEVEL] = level
    _cpp_level_set[:] = [level]


def _warnings(debug: bool) -> None:
    """`WARNINGS` ignored here and, through PYTHONWARNINGS (read when Python starts), in the processes vLLM spawns,
    which import vLLM before they could run any of this package's code; the user's own PYTHONWARNINGS keeps
    precedence."""
    ours = [f"ignore:{text}:{category}" for text, category in WARNINGS]
    given = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w and w not in ours]
    if debug:
        for text, category in WARNINGS:
            warnings.filterwarnings("default", message=re.escape(text), category=getattr(builtins, category))
        if given:
            os.environ["PYTHONWARNINGS"] = ",".join(given)
        else:
            os.environ.pop("PYTHONWARNINGS", None)
        return
    for text, category in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=getattr(builtins, category))
    os.environ["PYTHONWARNINGS"] = ",".join(ours + given)
