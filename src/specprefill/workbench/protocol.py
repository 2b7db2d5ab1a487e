"""What a notebook measures under a profile, read from its parameters alone (no model, no data): the tasks, which of
them use the chat template, keep rates, configuration families, baselines, maximum length and samples. `reproduce
--prepare-only` prints it per notebook; every run writes it beside its results (`protocol.json`) and the report
shows it, so a profile's protocol can be compared with the paper's scripts without running anything."""

from __future__ import annotations

from specprefill.data import longbench
from specprefill.workbench import harness

FIELDS = ("tasks", "template", "keep_rates", "families", "baselines", "max_length", "samples")


def _names(value) -> list[str]:
    return list(value) if isinstance(value, (dict, list, tuple)) else []


def protocol(params: dict) -> dict:
    """The protocol of a notebook from its merged parameters (parameters cell, then the profile's values)."""
    lm_tasks = _names(params.get("lm_eval_tasks"))
    task_args = params.get("lm_eval_task_args") or {}
    categories = params.get("categories") or {}  # QPS: each category's own keep rate and timeout
    own, template = _tasks_and_template(params, lm_tasks, task_args, categories)
    rates = (
        params.get("keep_rates")
        or sorted({c["keep_rate"] for c in categories.values() if isinstance(c, dict) and "keep_rate" in c})
        or ([params["keep_rate"]] if params.get("keep_rate") is not None else [])
    )
    methods = _names(params.get("methods"))
    baselines = [m for m in methods if m != "specprefill"] + _names(params.get("baselines"))
    samples = _samples(params, lm_tasks)
    extra = {t: a for t, a in task_args.items() if a}
    return {
        "tasks": lm_tasks + [t for t in own if t not in lm_tasks],
        "template": template,
        "keep_rates": list(rates),
        "families": _names(params.get("families")) or (["specprefill"] if rates else []),
        "baselines": baselines,
        "max_length": params.get("max_model_len"),
        "samples": samples,
        **({"truncation": params["lm_eval_truncation"]} if lm_tasks and "lm_eval_truncation" in params else {}),
        **({"task_args": extra} if extra else {}),
        **({"speculators": _names(params.get("speculators"))} if params.get("speculators") else {}),
        **({"lengths": params["lengths"]} if params.get("lengths") else {}),
        **({"token_budget": params["token_budget"]} if params.get("token_budget") else {}),  # batched TTFT
        **(
            {
                "categories": {
                    k: f"keep {c.get('keep_rate')}, timeout {c.get('timeout_s')} s" if isinstance(c, dict) else str(c)
                    for k, c in categories.items()
                }
            }
            if isinstance(categories, dict) and categories
            else {}
        ),
        **({"scored_by": params["scorer"]} if "scorer" in params else {}),  # 08, 09
        **({"groups": _groups(params["groups"])} if isinstance(params.get("groups"), dict) else {}),  # 11
    }


def _groups(groups: dict) -> dict[str, str]:
    """The leaderboard's task groups: each one's tasks, prompts per task and length (and its own keep rates)."""
    out = {}
    for name, g in groups.items():
        g = g if isinstance(g, dict) else {}
        rates = f", keep {text(g['keep_rates'])}" if g.get("keep_rates") else ""
        out[name] = f"{text(g.get('tasks'))}: n = {g.get('n')} at {g.get('length')} tokens{rates}"
    return out


# notebook 01's offline datasets by the task name their rows carry
OFFLINE = {"analogue": "mdqa_squad_analogue"}


def _tasks_and_template(params: dict, lm_tasks: list[str], task_args: dict, categories: dict) -> tuple[list, str]:
    """The notebook's own tasks (beside its lm-eval ones) and which of all tasks go through the chat template."""
    dataset = params.get("dataset")
    offline = [] if dataset in (None, "longbench", "lm_eval") or categories else [OFFLINE.get(dataset, dataset)]
    own = _names(params.get("tasks")) or offline or _names(params.get("longbench_tasks"))
    if categories and params.get("dataset") == "longbench":  # QPS on LongBench rows: the categories' tasks
        own = [t for c in categories for t in longbench.QPS_TASKS.get(c, ())]
        untemplated = [t for t in own if t in longbench.UNTEMPLATED]
        if not params.get("chat_template"):
            return own, "none"
        return own, "all" + (f" but {', '.join(untemplated)}" if untemplated else "")
    templated = [t for t in lm_tasks if harness.uses_chat_template(t, bool(params.get("chat_template")), task_args)]
    plain = [t for t in lm_tasks if t not in templated]
    if not lm_tasks:
        return own, "-"
    if not templated:
        return own, "none"
    return own, "all" + (f" but {', '.join(plain)}" if plain else "")


def _samples(params: dict, lm_tasks: list[str]) -> str | int | None:
    """Samples per task: a QPS run's per-task counts (and lm-eval's limit), else n_samples or lm-eval's limit."""
    if params.get("tasks") and isinstance(params["tasks"], dict):
        samples = ", ".join(f"{t}: {n}" for t, n in params["tasks"].items())
        if lm_tasks and "lm_eval_limit" in params:
            samples += f"; lm-eval: {params['lm_eval_limit'] if params['lm_eval_limit'] is not None else 'all'}"
        return samples
    limit = params.get("n_samples", params.get("lm_eval_limit"))
    return "all" if limit is None and lm_tasks else limit


def text(value) -> str:
    """A protocol value as text: lists joined, dicts as `key: value` pairs, None as "-"."""
    if isinstance(value, list):
        return ", ".join(map(str, value)) if value else "-"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {v if isinstance(v, dict) else text(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


def lines(name: str, proto: dict) -> list[str]:
    """The protocol as indented lines under the notebook's name (for a terminal)."""
    return [name] + [f"  {k:<11} {text(v)}" for k, v in proto.items()]
