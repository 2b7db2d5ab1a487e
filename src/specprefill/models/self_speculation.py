"""Self-speculation: a "self:K" speculator is the base's first K layers, materialized once as a model directory of
its own from the base's safetensors."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path

from safetensors import safe_open

from specprefill.atomic import build_dir
from specprefill.cache import cache_dir
from specprefill.config import SELF_LOOK_AHEAD, SELF_PREFIX, SpecPrefillConfig
from specprefill.errors import SpecPrefillError
from specprefill.models.calibration import CALIBRATED_PREFIX
from specprefill.models.registry import INDEX, fingerprint, save_sharded

_TRUNCATED = re.compile(r"^(?P<model>.+):(?P<k>[^:/]+)$")  # <model>:K
SELF_MARK = "specprefill_self_speculator"  # config.json key of a truncated base: {"base", "layers", "of"}
_LAYER = re.compile(r"^(?:model\.|language_model\.model\.|model\.language_model\.)?layers\.(\d+)\.")
SELF_FILES = ("*.json", "tokenizer*", "*.model", "vocab.txt", "merges.txt", "*.jinja", "*.tiktoken")
HEADS_KEY = "specprefill_score_heads"  # config.json key of a calibrated speculator: the heads it scores with
PER_LAYER_KEYS = ("layer_types", "sliding_window_pattern_list", "mlp_only_layers")


def base_layers(path: str) -> int:
    config = json.loads((Path(path) / "config.json").read_text())
    if not isinstance(config.get("num_hidden_layers"), int):
        raise SpecPrefillError(
            f"self-speculation needs a decoder whose config.json has num_hidden_layers at the top "
            f"level; {path} has not (a multimodal or GPT-2-style config): use a speculator model"
        )
    return config["num_hidden_layers"]


def self_layers(spec: str, n_layers: int | None) -> int:
    """ "self:K" -> K, "self:0.25" -> round(0.25 * n_layers) (at least 1); K must leave the base at least one layer.
    The same for "<model>:K" (that model's first K layers)."""
    if spec.startswith(SELF_PREFIX):
        own, text = SELF_PREFIX, spec[len(SELF_PREFIX) :]
    else:
        prefix, _, text = spec.rpartition(":")
        own = f"{prefix}:"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < 1 or (value >= 1 and math.isfinite(value) and value == int(value))):
        raise SpecPrefillError(
            f"speculator {spec!r}: write {own}K (a layer count, e.g. {own}4) or {own}F (a fraction "
            f"of the model's layers, e.g. {own}0.25)"
        )
    if n_layers is None:
        return 0
    k = int(value) if value >= 1 else max(1, round(value * n_layers))
    if k >= n_layers:
        raise SpecPrefillError(
            f"speculator {spec!r}: the model has {n_layers} layers; use fewer ({own}1 ... "
            f"{own}{n_layers - 1}) or the whole model"
        )
    return k


def carried_heads(path: str) -> str | None:
    """The `score_heads` a calibrated speculator's directory carries (config.json), else None."""
    p = Path(path) / "config.json"
    value = json.loads(p.read_text()).get(HEADS_KEY) if p.is_file() else None
    return str(value) if value else None


def is_self_speculator(path: str) -> bool:
    p = Path(path) / "config.json"
    return p.is_file() and SELF_MARK in json.loads(p.read_text())


def truncated_name(speculator: str) -> str | None:
    """The model of a "<model>:K" speculator (its first K layers), else None (self:K, calibrated:S, a path)."""
    match = _TRUNCATED.match(speculator)
    if (
        match is None
        or speculator.startswith((SELF_PREFIX, CALIBRATED_PREFIX))
        or os.path.exists(os.path.expanduser(speculator))
    ):
        return None
    return match["model"]


def default_look_ahead(speculator: str | None) -> int:
    """The look-ahead a speculator gets when none is given, by name or resolved (the one rule): 1 for a model's
    first layers (self:K, <model>:K, calibrated:S: their logits are not a language model's), else the config's
    default."""
    name = str(speculator or "")
    cut = name.startswith((SELF_PREFIX, CALIBRATED_PREFIX)) or truncated_name(name) is not None
    return SELF_LOOK_AHEAD if cut or (bool(name) and is_self_speculator(name)) else SpecPrefillConfig.look_ahead


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


def self_speculator(base_path: str, k: int, heads: str | None = None) -> Path:
    """The model's first k layers as a model directory of its own: the model's config with k layers, its tokenizer
    and config files, and only the tensors of layers < k plus the embeddings, final norm and head (read tensor by
    tensor from the model's safetensors, never the whole model). Cached per model (`_self_key`); built atomically.
    `heads`: the `score_heads` it carries (a calibrated speculator), written into its config.json."""
    base = Path(base_path)
    files = _weight_files(base)
    if not files:
        raise SpecPrefillError(
            f"self-speculation reads the base's safetensors files; {base} has none: save the base "
            "with save_pretrained (safetensors) first"
        )

    def build(out: Path) -> None:
        out.mkdir()
        for pattern in SELF_FILES:
            for f in sorted(base.glob(pattern)):  # copies: sorted so no step depends on the listing order
                if f.is_file() and f.name != INDEX:
                    shutil.copy2(f, out / f.name)
        config = json.loads((base / "config.json").read_text())
        n = config["num_hidden_layers"]
        for key in PER_LAYER_KEYS:
            if isinstance(config.get(key), list) and len(config[key]) == n:
                config[key] = config[key][:k]
        config.update({"num_hidden_layers": k, SELF_MARK: {"base": fingerprint(base), "layers": k, "of": n}})
        if heads:
            config[HEADS_KEY] = heads
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
            raise SpecPrefillError(
                f"self-speculation cannot find layers 0..{n - 1} in {base}'s tensor names "
                "(expected model.layers.N.*): this architecture is not supported, use a "
                "speculator model"
            )
        save_sharded(tensors, out)

    carried = f"-{hashlib.sha256(heads.encode()).hexdigest()[:12]}" if heads else ""
    target = cache_dir() / "self" / f"{base.name}-{_self_key(base)}-{k}{carried}"
    return build_dir(target, build, ready=lambda t: (t / INDEX).is_file())
