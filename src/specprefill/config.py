"""SpecPrefill's knobs, their defaults and checks: the one source the library, the CLI, the server, the notebooks'
parameters cells and the explorer take them from. No torch here, so the CLI's help stays fast."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specprefill.atomic import write_text
from specprefill.errors import SpecPrefillError

AGGREGATIONS = ("max", "mean")
SELF_PREFIX = "self:"  # a speculator spelled self:K is the base's first K layers (`models.resolve_speculator`)
SELF_LOOK_AHEAD = 1  # its default look-ahead: a truncated model's logits are not a language model's


def default_look_ahead(speculator: str | None) -> int:
    """The look-ahead a speculator gets when none is given: 1 for self-speculation, else the config's default."""
    return SELF_LOOK_AHEAD if str(speculator or "").startswith(SELF_PREFIX) else SpecPrefillConfig.look_ahead

def _knob(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass
class SpecPrefillConfig:
    """Knobs of SpecPrefill. Defaults follow the paper's full configuration with look-ahead 8."""

    keep_rate: float = _knob(0.1, "fraction of prompt tokens (or chunks) the base model receives, in (0, 1]")
    chunk_size: int = _knob(32, "tokens per selected chunk; 0 = token mode")
    look_ahead: int = _knob(8, "N: the last prompt token + N-1 greedy look-ahead tokens score the prompt")
    pool_kernel: int = _knob(13, "average pooling of the scores along the prompt; 0 = none, else odd")
    layer_head_agg: str = _knob("max", "how layers x heads are combined: max or mean")
    step_agg: str = _knob("mean", "how look-ahead steps are combined: max or mean")
    restore_positions: bool = _knob(True, "give kept tokens their original position ids")
    keep_first_chunk: bool = _knob(False, "always keep the first chunk")
    keep_last_chunk: bool = _knob(False, "always keep the last chunk")
    cross_token_agg: str = _knob("max", "cross-tokenizer pairs: how a base token combines the speculator tokens whose "
                                        "characters overlap it (max or mean)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.keep_rate, bool) or not isinstance(self.keep_rate, (int, float)) or not (
            0.0 < float(self.keep_rate) <= 1.0
        ):
            raise SpecPrefillError(f"keep rate {self.keep_rate!r} is outside (0, 1]: pass e.g. 0.1 for 10%")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 0:
            raise SpecPrefillError(f"chunk size {self.chunk_size!r} must be an integer >= 0 (0 = token mode)")
        if not isinstance(self.look_ahead, int) or self.look_ahead < 1:
            raise SpecPrefillError(f"look-ahead {self.look_ahead!r} must be an integer >= 1 (1 = last prompt token only)")
        if not isinstance(self.pool_kernel, int) or self.pool_kernel < 0 or (
            self.pool_kernel > 1 and self.pool_kernel % 2 == 0
        ):
            raise SpecPrefillError(f"pool kernel {self.pool_kernel!r} must be 0 (none) or an odd integer such as 13")
        for name in ("layer_head_agg", "step_agg", "cross_token_agg"):
            if getattr(self, name) not in AGGREGATIONS:
                raise SpecPrefillError(f"{name} {getattr(self, name)!r} is unknown: use one of {', '.join(AGGREGATIONS)}")

    @classmethod
    def pick(cls, namespace: dict, **overrides) -> "SpecPrefillConfig":
        """The config fields a namespace has (a notebook's parameters: `pick(globals())`), defaults for the rest."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{**{k: namespace[k] for k in names if k in namespace}, **overrides})

    @classmethod
    def help(cls, name: str) -> str:
        return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)

    def replace(self, **changes) -> "SpecPrefillConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SpecPrefillConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecPrefillError(f"unknown SpecPrefill config key(s) {unknown}: valid keys are {sorted(known)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "SpecPrefillConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise SpecPrefillError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))
