"""Settings that serve one consumer each, beside the knobs and engine parameters of `config`: how `calibrate` picks
heads (`CalibrationSettings`), lm-eval's tasks in the quality notebook (`LmEvalSettings`), where `reproduce` runs
(`ExecutorSettings`) and the multi-turn chat benchmark (`ChatSettings`). Dataclasses the CLI, the notebooks and
`_profile.yaml` take their flags and keys from (`specprefill.flags`); no torch or vLLM here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specprefill.errors import SpecPrefillError


@dataclass
class CalibrationSettings:
    """How `specprefill calibrate` picks a speculator's layers and heads for one base (`specprefill.calibrate`)."""

    prompts: int = field(default=12, metadata={"help": "generated calibration prompts (NIAH variants, multi-hop, QA)"})
    length: int = field(default=2048, metadata={"help": "tokens per calibration prompt (the base's tokens)"})
    keep_rate: float = field(default=0.1, metadata={"help": "the keep rate the head set is chosen for"})
    calibration_seed: int = field(
        default=0, metadata={"help": "seed of the generated prompts (drawn apart from the evaluation rows)"}
    )
    tolerance: float = field(
        default=0.02,
        metadata={"help": "needle recall the cut may give up against the best head set found, for fewer layers"},
    )
    max_heads: int = field(default=16, metadata={"help": "the most (layer, head) pairs a calibrated set scores with"})

    def __post_init__(self) -> None:
        if not (isinstance(self.prompts, int) and self.prompts >= 1):
            raise SpecPrefillError(f"prompts {self.prompts!r}: give at least 1")
        if not (isinstance(self.length, int) and self.length >= 256):
            raise SpecPrefillError(f"length {self.length!r}: give at least 256 tokens")
        if not (0 < float(self.keep_rate) < 1):
            raise SpecPrefillError(f"keep rate {self.keep_rate!r} is outside (0, 1): e.g. 0.1")
        if not (0 <= float(self.tolerance) < 1):
            raise SpecPrefillError(f"tolerance {self.tolerance!r} is outside [0, 1): e.g. 0.02")
        if not (isinstance(self.max_heads, int) and self.max_heads >= 1):
            raise SpecPrefillError(f"max_heads {self.max_heads!r}: give at least 1")


@dataclass
class LmEvalSettings:
    """lm-evaluation-harness tasks run beside a quality notebook's own records (`workbench.quality.lm_eval_quality`).
    The fields are the notebooks' parameters of the same names: `LmEvalSettings.pick(globals())`."""

    lm_eval_tasks: list[str] = field(default_factory=list)  # e.g. ["longbench_hotpotqa"] (none: no lm-eval run)
    lm_eval_limit: int | None = None  # samples per task (None: all)
    lm_eval_metadata: dict[str, Any] = field(default_factory=dict)  # passed to the tasks (RULER's lengths)
    lm_eval_include_path: str | None = None  # a folder of task definitions besides lm-eval's and the project's
    chat_template: bool = False  # through the model's chat template as the original ran each task
    data_dir: str | None = None  # every task's rows from this folder, in the benchmark's own schema
    lm_eval_max_gen_toks: int | None = None  # a cap on every answer's length (None: each task's own)
    lm_eval_task_args: dict[str, Any] = field(default_factory=dict)  # {task: {chat_template, num_fewshot, ...}}
    lm_eval_truncation: str = "left"  # which part of a prompt longer than the context is cut: left, middle, right

    @classmethod
    def pick(cls, namespace: dict[str, Any], **overrides: Any) -> LmEvalSettings:
        """The fields a namespace has (a notebook's parameters), defaults for the rest."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{**{k: namespace[k] for k in names if k in namespace}, **overrides})

    def replace(self, **changes: Any) -> LmEvalSettings:
        return dataclasses.replace(self, **changes)


EXECUTORS = ("inline", "local", "slurm")


@dataclass(frozen=True)
class ExecutorSettings:
    """Where `reproduce` computes a profile's units (`workbench.cluster`): flags `--executor`, `--jobs`, ...; a
    profile's `_profile.yaml` may hold the same keys under `executor:` (a flag given wins)."""

    executor: str = field(
        default="inline",
        metadata={
            "help": "inline (this process, one notebook after another), local (jobs on this machine, each on its "
            "own GPUs or cores) or slurm (a job array)",
            "choices": EXECUTORS,
        },
    )
    jobs: int = field(default=2, metadata={"help": "at most this many jobs (local: also at most one per GPU set)"})
    units_per_job: int | None = field(
        default=None, metadata={"help": "instead of --jobs: as many jobs as this many units each need"}
    )
    partition: str | None = field(default=None, metadata={"help": "Slurm partition"})
    account: str | None = field(default=None, metadata={"help": "Slurm account"})
    gpus_per_job: int | None = field(
        default=None,
        metadata={"help": "GPUs per job (default: its notebooks' widest tensor-parallel engine; 0: CPU-only nodes)"},
    )
    cpus_per_job: int | None = field(
        default=None, metadata={"help": "CPU cores per job (default: local an equal share, Slurm 8 per GPU)"}
    )
    timeout_min: int = field(default=24 * 60, metadata={"help": "a job's time limit in minutes (Slurm requeues it)"})
    array_parallelism: int = field(default=64, metadata={"help": "Slurm: jobs of the array running at once"})
    setup: str | None = field(
        default=None,
        metadata={"help": "shell lines each Slurm job runs first, separated by ';' (e.g. 'module load cuda')"},
    )

    @classmethod
    def of(cls, profile_block: dict[str, Any] | None, given: dict[str, Any]) -> ExecutorSettings:
        """The profile's `executor:` block, then the flags given."""
        names = [f.name for f in dataclasses.fields(cls)]
        block = dict(profile_block or {})
        unknown = sorted(set(block) - set(names))
        if unknown:
            raise SpecPrefillError(f"_profile.yaml executor: keys {unknown} are unknown: use {', '.join(names)}")
        flags = {k: v for k, v in given.items() if v is not None and k in names}
        if "jobs" in flags and "units_per_job" not in flags:  # a --jobs given wins over the profile's units_per_job
            block.pop("units_per_job", None)
        values = {**block, **flags}
        if isinstance(values.get("setup"), list):  # a YAML list of lines
            values["setup"] = "; ".join(values["setup"])
        settings = cls(**values)
        if settings.executor not in EXECUTORS:
            raise SpecPrefillError(f"executor {settings.executor!r}: use one of {', '.join(EXECUTORS)}")
        for name in ("jobs", "units_per_job", "gpus_per_job", "cpus_per_job", "timeout_min", "array_parallelism"):
            value = getattr(settings, name)
            least = 0 if name == "gpus_per_job" else 1
            if value is not None and value < least:
                raise SpecPrefillError(f"--{name.replace('_', '-')} {value}: give at least {least}")
        return settings


@dataclass
class ChatSettings:
    """`specprefill bench chat` (and notebook 05's chat section): conversations replayed turn by turn against servers
    built from the same base arguments (`workbench.chat`)."""

    chat_conversations: int = field(
        default=3, metadata={"help": "conversations, each over its own seeded document (0: none)"}
    )
    chat_turns: int = field(
        default=4, metadata={"help": "user turns per conversation (the third asks about the first answer)"}
    )
    chat_doc_tokens: int = field(
        default=3500, metadata={"help": "tokens of each conversation's document (base tokenizer)"}
    )
    chat_answer_tokens: int = field(default=16, metadata={"help": "max_tokens of every answer"})
    chat_servers: str = field(
        default="vllm,specprefill,specprefill-no-reuse",
        metadata={
            "help": "servers, each measured alone (started, run and stopped one at a time): vllm (prefix "
            "caching), specprefill (as served: prefix caching, earlier requests reused as core.turns allows), "
            "specprefill-no-reuse (fresh: no prefix caching, each request "
            "speculated and prefilled anew)"
        },
    )
    chat_seed: int = field(default=0, metadata={"help": "seed of the documents and questions"})
    chat_modes: str = field(
        default="conversation,agent",
        metadata={
            "help": "workloads, comma-separated: conversation (a document, then questions about other parts of it "
            "and one about an earlier answer), agent (each later turn appends chat_agent_tokens of new material, a "
            "tool's output, and asks about it), shared and shared-tenants (SCBench's multi-request mode: each "
            "document asked chat_turns questions by different users, as one tenant / with a cache_salt per user)"
        },
    )
    chat_agent_tokens: int = field(
        default=1500, metadata={"help": "tokens of new material each later agent turn appends (base tokenizer)"}
    )
    chat_think_times: str = field(
        default="0,2,10,30",
        metadata={
            "help": "seconds from the end of an answer to the next request (0: sent as the answer ends), "
            "comma-separated: every workload runs once per value; no request waits for a server's background work"
        },
    )
    chat_block_size: int | None = field(
        default=32,
        metadata={
            "help": "KV block size of every server's base (None: vLLM's; on CPU its 128 leaves up to 127 tokens of a "
            "turn's cached prefix to compute again, on every server alike)"
        },
    )

    def __post_init__(self) -> None:
        self.think_times()  # a one-line error for a bad list
        modes = self.modes()
        if not modes or set(modes) - set(CHAT_MODES):
            raise SpecPrefillError(f"chat_modes {self.chat_modes!r}: name some of {', '.join(CHAT_MODES)}")
        for name, least in (
            ("chat_conversations", 0),
            ("chat_turns", 1),
            ("chat_answer_tokens", 1),
            ("chat_agent_tokens", 64),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SpecPrefillError(f"{name} {value!r}: give an integer >= {least}")
        if (
            isinstance(self.chat_doc_tokens, bool)
            or not isinstance(self.chat_doc_tokens, int)
            or self.chat_doc_tokens < 64
        ):
            raise SpecPrefillError(f"chat_doc_tokens {self.chat_doc_tokens!r}: give at least 64")
        known = ("vllm", "specprefill", "specprefill-no-reuse")
        names = self.server_kinds()
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise SpecPrefillError(f"chat_servers {self.chat_servers!r}: name some of {', '.join(known)}")

    @classmethod
    def pick(cls, namespace: dict[str, Any]) -> ChatSettings:
        """The fields found by name in `namespace` (a notebook's parameters), defaults for the rest."""
        return cls(**{f.name: namespace[f.name] for f in dataclasses.fields(cls) if f.name in namespace})

    def server_kinds(self) -> list[str]:
        return _names(self.chat_servers)

    def modes(self) -> list[str]:
        return _names(self.chat_modes)

    def think_times(self) -> list[float]:
        """`chat_think_times` as seconds (a one-line error naming the fix for anything else)."""
        try:
            times = [float(t) for t in _names(str(self.chat_think_times))]
        except ValueError:
            times = []
        if not times or any(not 0 <= t < float("inf") for t in times):
            raise SpecPrefillError(f"chat_think_times {self.chat_think_times!r}: give seconds >= 0, e.g. 0,2,10,30")
        return times


CHAT_MODES = ("conversation", "agent", "shared", "shared-tenants")  # `ChatSettings.chat_modes`


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]
