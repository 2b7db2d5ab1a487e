"""Name resolution: a registry name, a local model directory or a hub id (probed quickly) becomes what the engines
load; "self:K" speculators are built from the base (`self_speculation`)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from specprefill.config import SELF_PREFIX
from specprefill.errors import SpecPrefillError
from specprefill.models.calibration import CALIBRATED_PREFIX, load_calibration
from specprefill.models.registry import INDEX, MODELS, materialize, model_dir
from specprefill.models.self_speculation import SELF_FILES, base_layers, self_layers, self_speculator, truncated_name

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


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
        f"unknown model {name_or_path!r}: use one of {', '.join(MODELS)}, a local model directory, or a hub id like "
        "org/name"
    )


def resolve_speculator(speculator: str, base: str | None, materialize_missing: bool = True) -> str:
    """`resolve` for a speculator, plus three derived ones, each materialized once from a model's weights
    (`self_speculator`):
    - "self:K" (K layers) or "self:F" (a fraction 0 < F < 1 of the layers): the base's first K layers;
    - "<model>:K" / "<model>:F": any model's first K layers (a truncated speculator);
    - "calibrated:<model>": the model cut and scored as `specprefill calibrate` chose for this base."""
    if speculator.startswith(CALIBRATED_PREFIX):
        name = speculator[len(CALIBRATED_PREFIX) :]
        base_path = _needs_base(speculator, base, materialize_missing)
        spec_path = resolve_speculator(name, base, materialize_missing)  # itself a self:K or <model>:K
        if not materialize_missing:
            return speculator
        chosen = load_calibration(name, spec_path, str(base), base_path)
        return str(self_speculator(_local(spec_path), chosen["layers"], chosen["score_heads"]))
    truncated = truncated_name(speculator)
    if truncated is not None:
        model_path = resolve(truncated, materialize_missing)
        if not materialize_missing:
            self_layers(speculator, None)  # the spelling only
            return speculator
        model_path = _local(model_path)
        return str(self_speculator(model_path, self_layers(speculator, base_layers(model_path))))
    if not speculator.startswith(SELF_PREFIX):
        return resolve(speculator, materialize_missing)
    base_path = _needs_base(speculator, base, materialize_missing)
    if not materialize_missing:
        self_layers(speculator, None)  # the spelling only
        return speculator
    base_path = _local(base_path)
    return str(self_speculator(base_path, self_layers(speculator, base_layers(base_path))))


def _needs_base(speculator: str, base: str | None, materialize_missing: bool) -> str:
    if base is None:
        raise SpecPrefillError(
            f"speculator {speculator!r} is derived from the base model: give a base model as well "
            "(--base, base=) or name a speculator model"
        )
    return resolve(base, materialize_missing)


def _local(path: str) -> str:
    """A model directory: a hub id's config, tokenizer and safetensors downloaded (no other weight formats)."""
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=[*SELF_FILES, "*.safetensors", INDEX])


def check_model_dir(path: str) -> str:
    """A local model must be a Hugging Face-format directory; otherwise say which files are missing."""
    p = Path(path)
    if not p.is_dir():
        fix = (
            " (a GGUF file: dequantize it first, with transformers' `gguf_file=` and `save_pretrained`)"
            if p.suffix == ".gguf"
            else ""
        )
        raise SpecPrefillError(f"model {path!r} is a file: pass a Hugging Face-format model directory{fix}")
    missing = [
        what
        for what, ok in (
            ("config.json", (p / "config.json").is_file()),
            ("weights (*.safetensors or *.bin)", any(any(p.glob(g)) for g in WEIGHT_FILES)),
            (
                "tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
                any((p / f).is_file() for f in TOKENIZER_FILES),
            ),
        )
        if not ok
    ]
    if missing:
        raise SpecPrefillError(
            f"{path} holds no model: missing {'; '.join(missing)}. Pass a Hugging Face-format "
            f"model directory or a registry name ({', '.join(MODELS)})"
        )
    return path


@functools.cache
def check_hub_id(repo: str, timeout_s: float = 3.0) -> str:
    """A hub id is used as is when its files are in the local Hugging Face cache or the hub answers within a few
    seconds; offline (HF_HUB_OFFLINE, or no answer) and not cached is a one-line error now, not a minute of retries."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo, "config.json"), str):
        return repo
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _hub_unreachable(constants.ENDPOINT, timeout_s)
    if why:
        raise SpecPrefillError(
            f"model {repo!r} is not in the local Hugging Face cache and {why}: pass a local model "
            f"directory or a registry name ({', '.join(MODELS)})"
        )
    return repo


def _hub_unreachable(endpoint: str, timeout_s: float) -> str | None:
    import requests

    try:
        requests.head(endpoint, timeout=timeout_s, allow_redirects=False)
    except requests.RequestException as exc:
        return f"the hub ({endpoint}) could not be reached within {timeout_s:g} s ({type(exc).__name__})"
    return None
