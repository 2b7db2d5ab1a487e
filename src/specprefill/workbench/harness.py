"""How the paper's quality protocol runs lm-evaluation-harness tasks: which tasks get the model's chat template (as
the original did) and where their data comes from (the hub, or a local directory in the hub's own schema).

- Chat template: with `chat_template=True` every task runs through the model's chat template, few-shot examples as
  a multi-turn conversation (lm-eval's `apply_chat_template` + `fewshot_as_multiturn`), except LongBench's trec,
  triviaqa, samsum, lsht, lcc and repobench-p (and their LongBench-E twins), which LongBench's own prediction script
  leaves untemplated.
- Local data: `local_tasks` writes, for every task whose dataset is in the directory (`DIR/<dataset>/<config>.jsonl`,
  e.g. `DIR/longbench/hotpotqa.jsonl`, `DIR/gsm8k/main.jsonl`, `DIR/ai2_arc/ARC-Challenge.jsonl`), a task definition
  that is lm-eval's own (prompt, few-shot, generation settings, metric, via `include`) reading those rows instead of
  the hub. LongBench rows may carry the hub's `input` field where lm-eval's copy of LongBench calls it `question`.
"""

from __future__ import annotations

import os
from pathlib import Path

from specprefill.atomic import write_text
from specprefill.workbench import store

LONGBENCH_UNTEMPLATED = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
LOCAL_PREFIX = "local_"  # a task read from the data directory is named local_<task>; rows carry <task>


def longbench_config(task: str) -> str | None:
    """LongBench's config name of an lm-eval task (`longbench_hotpotqa_e` -> `hotpotqa_e`), None for other tasks."""
    return task.removeprefix("longbench_") if task.startswith("longbench_") else None


def uses_chat_template(task: str, chat_template: bool) -> bool:
    """Whether `task` runs through the chat template when the protocol asks for templates (`chat_template`)."""
    config = longbench_config(task)
    return chat_template and (config is None or config.removesuffix("_e") not in LONGBENCH_UNTEMPLATED)


def template_groups(tasks: list[str], chat_template: bool) -> dict[bool, list[str]]:
    """Tasks split by whether they use the chat template (one lm-eval run per group), in the given order."""
    groups: dict[bool, list[str]] = {}
    for task in tasks:
        groups.setdefault(uses_chat_template(task, chat_template), []).append(task)
    return groups


_DOCS = '''"""Written by specprefill: LongBench rows in the hub's schema, as lm-eval's copy of LongBench reads them."""


def hub_schema(dataset):
    if "question" in dataset.column_names:
        return dataset
    return dataset.map(lambda doc: {"question": doc.get("input", "")})
'''
SPLITS = ("test_split", "validation_split", "training_split", "fewshot_split")


def local_files(cfg: dict, data_dir: str | os.PathLike) -> dict[str, Path] | None:
    """The files of a task's dataset in `data_dir`, by split: `DIR/<dataset>/<config>.jsonl` (dataset: the last part
    of the hub path, lower case; config: the hub config or `default`), `<config>.<split>.jsonl` where a split has its
    own rows. None when the directory does not hold the dataset."""
    if not cfg.get("dataset_path"):
        return None
    folder = Path(data_dir) / Path(str(cfg["dataset_path"])).name.lower()
    config = cfg.get("dataset_name") or "default"
    if not (folder / f"{config}.jsonl").exists():
        return None
    splits = {cfg[k] for k in SPLITS if cfg.get(k)}
    return {
        s: next(p for p in (folder / f"{config}.{s}.jsonl", folder / f"{config}.jsonl") if p.exists()) for s in splits
    }


def local_tasks(
    tasks: list[str], data_dir: str | os.PathLike | None, out_dir: str | os.PathLike
) -> tuple[dict[str, str], dict[str, str]]:
    """({lm-eval task: the task to run}, {task: digest of its local rows}): a task whose dataset `data_dir` holds
    (`local_files`) maps to a task definition written under `out_dir` (pass it as lm-eval's include path) that is
    lm-eval's own (`include`) reading those files; every other task maps to itself."""
    if data_dir is None:
        return {t: t for t in tasks}, {}
    from lm_eval.tasks import TaskManager  # lazy: only runs with lm-eval tasks import it
    from lm_eval.tasks._yaml_loader import load_yaml  # the loader lm-eval's task index uses (includes resolved)

    index = TaskManager().task_index
    out = Path(out_dir)
    names, digests = {}, {}
    for task in tasks:
        entry = index.get(task)
        cfg = load_yaml(entry.yaml_path, resolve_func=False) if entry and entry.kind.name == "TASK" else {}
        files = local_files(cfg, data_dir)
        if not files:
            names[task] = task
            continue
        names[task] = LOCAL_PREFIX + task
        digests[task] = store.digest({s: p.read_text() for s, p in sorted(files.items())})
        data_files = "".join(f"    {s}: {p.resolve()}\n" for s, p in sorted(files.items()))
        definition = (
            f"include: {entry.yaml_path}\n"
            f"task: {LOCAL_PREFIX + task}\n"
            "tag: []\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n{data_files}"
        )
        if longbench_config(task):  # lm-eval's copy of LongBench names the hub's `input` field `question`
            definition += "process_docs: !function local_docs.hub_schema\n"
        write_text(out / f"{LOCAL_PREFIX + task}.yaml", definition)
    if digests:
        write_text(out / "local_docs.py", _DOCS)
    return names, digests


def task_name(run_name: str) -> str:
    """The task a run reports: a local task under its lm-eval name."""
    return run_name.removeprefix(LOCAL_PREFIX)
