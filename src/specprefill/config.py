"""SpecPrefill's knobs (`SpecPrefillConfig`) and engine parameters (`EngineParams`), their defaults and checks: the one
source the library, the CLI, the server, lm-eval's model arguments, the notebooks' parameters cells and the explorer
take them from (`specprefill.flags` turns fields into flags). No torch or vLLM here, so the CLI's help stays fast."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specprefill.atomic import write_text
from specprefill.errors import SpecPrefillError

AGGREGATIONS = ("max", "mean")
UNITS = ("chunks", "lines", "records")  # what a score selects (`core.units`)
QUESTION_TOKENS = 128  # the protected question: at most this many tokens, from its end

_ORIGINAL = {"selection_unit": "chunks", "protect": False, "query_weight": 0.0}
# label -> the select-stage knobs of a rule; "chunks" is the original's (fixed chunk_size tokens, nothing protected)
SELECTION_RULES: dict[str, dict[str, Any]] = {
    "chunks": _ORIGINAL,
    "chunks+protect": {**_ORIGINAL, "protect": True},
    "lines": {**_ORIGINAL, "selection_unit": "lines"},
    "records": {**_ORIGINAL, "selection_unit": "records"},
    "lines+protect": {**_ORIGINAL, "selection_unit": "lines", "protect": True},
    "records+protect": {**_ORIGINAL, "selection_unit": "records", "protect": True},
    "records+protect+query": {**_ORIGINAL, "selection_unit": "records", "protect": True, "query_weight": 1.0},
    "chunks+protect+query": {**_ORIGINAL, "protect": True, "query_weight": 1.0},
}
# what `specprefill serve`, the CLI's other commands and `SpecPrefillLLM` select by default (docs/measurements.md,
# "Selection rules"); `SpecPrefillConfig()`, the notebooks' paper profiles and the lm-eval model keep the original's
SERVING_RULE = "records+protect+query"
BACKGROUND_PREFILL = ("idle", "off")  # `EngineParams.background_prefill`
DTYPES = ("auto", "float32", "bfloat16", "float16")  # what `hardware.resolve_dtype` takes
SELF_PREFIX = "self:"  # a speculator spelled self:K is the base's first K layers (`models.resolve_speculator`)
SELF_LOOK_AHEAD = 1  # its default look-ahead (`models.default_look_ahead`): its logits are not a language model's


HeadSet = dict[int, tuple[int, ...] | None]  # layer -> the heads scored in it (None: all of them)
_LAYERS = re.compile(r"^layers:(\d+)(?:-(\d+))?$")
_HEAD = re.compile(r"^(\d+)\.(\d+)$")
SCORE_HEADS_HELP = "all; layers:A-B (those layers, every head); or L.H,L.H,... (layer.head pairs, from 0)"


def parse_score_heads(spec: str) -> HeadSet | None:
    """`score_heads` as written -> the head set (None: every layer and head). "auto" here is "all": an engine
    replaces it by the set a calibrated speculator carries before it gets here."""
    text = str(spec).strip().replace(" ", "")
    if text in ("all", "auto"):
        return None
    if m := _LAYERS.match(text):
        first, last = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if last >= first:
            return {layer: None for layer in range(first, last + 1)}
    pairs = [_HEAD.match(part) for part in text.split(",")]
    if text and all(pairs):
        heads: dict[int, set[int]] = {}
        for pair in pairs:
            assert pair is not None
            heads.setdefault(int(pair[1]), set()).add(int(pair[2]))
        return {layer: tuple(sorted(h)) for layer, h in sorted(heads.items())}
    raise SpecPrefillError(f"score_heads {spec!r} is not understood: write {SCORE_HEADS_HELP}")


def is_keep_rate(rate: Any) -> bool:
    """The one keep-rate rule: a number (not a bool) in (0, 1]; 1 runs the whole prompt."""
    return not isinstance(rate, bool) and isinstance(rate, (int, float)) and 0.0 < float(rate) <= 1.0


def _knob(default: Any, text: str, stage: str, **kw: Any) -> Any:
    """A config field; `stage`: where it acts, "score" (the speculator's scores), "select" (top-k) or "prefill"."""
    return field(default=default, metadata={"help": text, "stage": stage, **kw})


@dataclass
class SpecPrefillConfig:
    """Knobs of SpecPrefill. Defaults follow the paper's full configuration with look-ahead 8."""

    keep_rate: float = _knob(0.1, "fraction of prompt tokens (or chunks) the base model receives, in (0, 1]", "select")
    chunk_size: int = _knob(32, "tokens per selected chunk (0: token mode)", "select")
    look_ahead: int = _knob(
        8,
        "N: the last prompt token + N-1 greedy look-ahead tokens score the prompt "
        "(a self:K, <model>:K or calibrated:S speculator: 1 unless given)",
        "score",
    )
    pool_kernel: int = _knob(13, "average pooling of the scores along the prompt (0: none, else odd)", "score")
    layer_head_agg: str = _knob("max", "how layers x heads are combined", "score", choices=AGGREGATIONS)
    step_agg: str = _knob("mean", "how look-ahead steps are combined", "score", choices=AGGREGATIONS)
    restore_positions: bool = _knob(True, "give kept tokens their original position ids", "prefill")
    selection_unit: str = _knob(
        "chunks",
        "what a score selects: chunks (the original's, chunk_size tokens), lines (at most chunk_size tokens, starting "
        "where a line or sentence starts), records (lines; a kept unit brings its line's and its record's first unit)",
        "select",
        choices=UNITS,
    )
    protect: bool = _knob(
        False,
        f"always keep the questions (before and/or after the document, in the last user message or the system "
        f"message; at most {QUESTION_TOKENS} tokens each), a short system message, tool definitions and the chat "
        f"template's markers, within protect_share of the budget",
        "select",
    )
    query_weight: float = _knob(
        0.0,
        "add this x each unit's share of the question's rare words to its attention score (max 1); under records, a "
        "question asked before the document that names records keeps those alone (usually far under budget); 0: off",
        "select",
    )
    protect_share: float = _knob(
        0.5,
        "the most of the budget protected spans take (questions first, each kept from its end); logged when it binds",
        "select",
    )
    cross_token_agg: str = _knob(
        "max",
        "cross-tokenizer pairs: how a base token combines the speculator tokens whose characters overlap it",
        "score",
        choices=AGGREGATIONS,
    )
    score_heads: str = _knob(
        "auto",
        f"the speculator's (layer, head) pairs that score: auto (a calibrated speculator's own set, else all); "
        f"{SCORE_HEADS_HELP}",
        "score",
    )

    def __post_init__(self) -> None:
        self.validate()

    def with_heads(self, carried: str | None) -> SpecPrefillConfig:
        """`score_heads` "auto" made concrete for a speculator: the set it carries (a calibrated one), else all."""
        if str(self.score_heads).strip() != "auto":
            return self
        return dataclasses.replace(self, score_heads=carried or "all")

    def validate(self) -> None:
        if not is_keep_rate(self.keep_rate):
            raise SpecPrefillError(f"keep rate {self.keep_rate!r} is outside (0, 1]: pass e.g. 0.1 for 10%")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 0:
            raise SpecPrefillError(f"chunk size {self.chunk_size!r} must be an integer >= 0 (0 = token mode)")
        if not isinstance(self.look_ahead, int) or self.look_ahead < 1:
            raise SpecPrefillError(
                f"look-ahead {self.look_ahead!r} must be an integer >= 1 (1 = last prompt token only)"
            )
        if (
            not isinstance(self.pool_kernel, int)
            or self.pool_kernel < 0
            or (self.pool_kernel > 1 and self.pool_kernel % 2 == 0)
        ):
            raise SpecPrefillError(f"pool kernel {self.pool_kernel!r} must be 0 (none) or an odd integer such as 13")
        parse_score_heads(self.score_heads)
        if self.selection_unit not in UNITS:
            raise SpecPrefillError(f"selection unit {self.selection_unit!r} is unknown: use one of {', '.join(UNITS)}")
        if self.selection_unit != "chunks" and self.chunk_size < 1:
            raise SpecPrefillError(
                f"selection unit {self.selection_unit!r} needs chunk_size >= 1 (token mode has no lines): "
                "pass chunks for it"
            )
        if (
            isinstance(self.query_weight, bool)
            or not isinstance(self.query_weight, (int, float))
            or self.query_weight < 0
        ):
            raise SpecPrefillError(f"query weight {self.query_weight!r} must be a number >= 0 (0: off)")
        if (
            isinstance(self.protect_share, bool)
            or not isinstance(self.protect_share, (int, float))
            or not 0 < self.protect_share <= 1
        ):
            raise SpecPrefillError(f"protect share {self.protect_share!r} must be in (0, 1], e.g. 0.5")
        for name in ("layer_head_agg", "step_agg", "cross_token_agg"):
            if getattr(self, name) not in AGGREGATIONS:
                raise SpecPrefillError(
                    f"{name} {getattr(self, name)!r} is unknown: use one of {', '.join(AGGREGATIONS)}"
                )

    @property
    def rule(self) -> str:
        """The selection rule these knobs are (`SELECTION_RULES`' label, e.g. "chunks", the original's, or
        "records+protect+query", the serving default), or "custom (...)" naming them."""
        knobs = {k: getattr(self, k) for k in _ORIGINAL}
        for label, rule in SELECTION_RULES.items():
            if knobs == rule:
                return label
        return "custom (" + ", ".join(f"{k}={v}" for k, v in knobs.items()) + ")"

    @property
    def needs_layout(self) -> bool:
        """Whether selection reads the prompt's text (`core.Layout`), not only its scores."""
        return self.selection_unit != "chunks" or bool(self.protect) or self.query_weight > 0

    @classmethod
    def pick(cls, namespace: dict[str, Any], **overrides: Any) -> SpecPrefillConfig:
        """The config fields a namespace has (a notebook's parameters: `pick(globals())`), defaults for the rest."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{**{k: namespace[k] for k in names if k in namespace}, **overrides})

    @classmethod
    def help(cls, name: str) -> str:
        text: str = next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)
        return text

    def replace(self, **changes: Any) -> SpecPrefillConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecPrefillConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecPrefillError(f"unknown SpecPrefill config key(s) {unknown}: valid keys are {sorted(known)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> SpecPrefillConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise SpecPrefillError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


def _param(default: Any, text: str, role: str, **kw: Any) -> Any:
    """An engine parameter; `role`: whose engine argument it is — "base", "speculator" (the vLLM name after the
    `speculator_` prefix), "both" (the same value to each engine) or "pair" (the project's, no vLLM argument)."""
    metadata = {"help": text, "role": role, **kw}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EngineParams:
    """How the engines of a pair are built (`engines.vllm.builder`, the one place that builds them). vLLM engine
    arguments go by vLLM's own names for the base and with a `speculator_` prefix for the speculator; `engine_args` /
    `speculator_engine_args` carry any other vLLM engine argument. Memory left open is sized for two engines."""

    speculator: str = _param(
        dataclasses.MISSING,
        "speculator: registry name, local directory, hub id, self:K (the base's first K layers), <model>:K (any "
        "model's first K layers) or calibrated:S (S as `specprefill calibrate` cut and scored it for this base)",
        "pair",
    )
    base: str | None = _param(
        None,
        "base model: registry name, local directory or hub id (none: the speculator alone, importance only)",
        "pair",
    )
    dtype: str = _param(
        "auto",
        "auto: bfloat16 where the CPU has native bf16 (AMX/AVX512-BF16), else float32; on GPUs vLLM's choice",
        "both",
        choices=DTYPES,
    )
    max_model_len: int | None = _param(
        None,
        "context of both engines (default: the model's; the CLI's generate/importance: prompt + new tokens)",
        "both",
    )
    seed: int | None = _param(None, "random seed of both engines", "both")
    tensor_parallel_size: int = _param(1, "base tensor parallel ranks (CPU: one core group per rank)", "base")
    speculator_tensor_parallel_size: int = _param(1, "speculator tensor parallel ranks", "speculator")
    gpu_memory_utilization: float | None = _param(
        None, "base share of GPU memory (default: split with the speculator by weight bytes)", "base"
    )
    speculator_gpu_memory_utilization: float | None = _param(None, "speculator share of GPU memory", "speculator")
    kv_cache_memory_bytes: int | None = _param(
        None, "base KV cache bytes (CPU default: kv_sequences x max_model_len tokens)", "base"
    )
    speculator_kv_cache_memory_bytes: int | None = _param(None, "speculator KV cache bytes", "speculator")
    kv_sequences: int = _param(4, "max_model_len sequences each CPU engine's KV cache holds", "pair")
    enforce_eager: bool | None = _param(
        None,
        "base without torch.compile / CUDA graphs (default: eager on CPU, where "
        "compiling does not pay for itself; vLLM's choice on GPUs); the "
        "speculator always runs eager",
        "base",
    )
    enable_prefix_caching: bool = _param(
        False,
        "prefix caching of both engines (off: every measurement computes its own prefill); on, a pruned "
        "request's KV blocks are shared only at the same original positions and within one cache_salt, and a "
        "repeated prompt or one adding to a prefix the base holds whole reuses it (see min_new_tokens)",
        "both",
    )
    max_num_seqs: int | None = _param(None, "base: requests scheduled at once", "base")
    max_num_batched_tokens: int | None = _param(None, "base: tokens per scheduler step", "base")
    max_speculation_tokens: int | None = _param(
        None,
        "prompt tokens speculated at once (bounds speculation memory; default: sized from the memory free once both "
        "engines started)",
        "pair",
    )
    min_prompt_tokens: int = _param(0, "prompts shorter than this run whole", "pair")
    min_new_tokens: int = _param(
        512,
        "with prefix caching: a request adding fewer new tokens than this to an earlier prompt and answer that the "
        "base holds whole (the server prefills them whole in idle time) runs whole, as plain vLLM; otherwise it "
        "is speculated afresh",
        "pair",
    )
    background_prefill: str = _param(
        "idle",
        "with prefix caching, in the server: idle = prefill a pruned request's prompt and answer whole on the base "
        "while no request is in flight (cancelled by any arriving request), so that a short follow-up runs whole; "
        "off = never (a follow-up that is not a repeat is speculated afresh)",
        "pair",
        choices=BACKGROUND_PREFILL,
    )
    background_tokens_per_tenant: int | None = _param(
        None,
        "with background prefill: the tokens one tenant's waiting background prefills may add up to (what is left to "
        "prefill of each); a tenant over it loses its oldest waiting ones, and a request over it alone is not "
        "prefilled in the background (default: max_model_len, one whole context per tenant)",
        "pair",
    )
    speculation_queue: int = _param(
        64,
        "in the server: requests waiting for the speculator beyond this many are refused (HTTP 503 with Retry-After) "
        "instead of queued without bound",
        "pair",
    )
    speculation_timeout_s: float = _param(
        600.0,
        "in the server: a speculation unfinished this many seconds after the speculator took it up is given up and "
        "its prompt runs whole, as plain vLLM runs it (one log line a minute); 0: no limit",
        "pair",
    )
    engine_args: dict[str, Any] = _param(
        {}, "any other vLLM engine argument of the base, by its Python name", "base", flag="engine-arg"
    )
    speculator_engine_args: dict[str, Any] = _param(
        {}, "any other vLLM engine argument of the speculator", "speculator", flag="speculator-engine-arg"
    )

    def __post_init__(self) -> None:
        self.engine_args = dict(self.engine_args or {})
        self.speculator_engine_args = dict(self.speculator_engine_args or {})

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def pick(cls, namespace: dict[str, Any], **overrides: Any) -> EngineParams:
        """The fields found by name in `namespace` (a notebook's parameters, a params YAML), defaults for the rest."""
        return cls(**{**{k: namespace[k] for k in cls.names() if k in namespace}, **overrides})

    def replace(self, **changes: Any) -> EngineParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as given (`hardware.engine_record` adds the dtype `auto` resolves to on this machine)."""
        return dataclasses.asdict(self)
