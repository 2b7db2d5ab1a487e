"""How the paper's quality protocol runs lm-evaluation-harness tasks: which tasks get the model's chat template (as
the original did) and where their data comes from (the hub, or a local directory in the hub's own schema).

- Chat template: with `chat_template=True` every task runs through the model's chat template, few-shot examples as
  a multi-turn conversation (lm-eval's `apply_chat_template` + `fewshot_as_multiturn`), except LongBench's trec,
  triviaqa, samsum, lsht, lcc and repobench-p (and their LongBench-E twins), which LongBench's own prediction script
  leaves untemplated.
- Local data: `local_tasks` writes, for every LongBench task whose rows are in `DIR/longbench/<config>.jsonl`, a task
  definition that is lm-eval's own (prompt, generation settings, metric, via `include`) reading that file instead of
  the hub. Rows may carry the hub's `input` field where lm-eval's copy of LongBench calls it `question`.
"""

from __future__ import annotations

import os
from pathlib import Path

from specprefill.atomic import write_text
from specprefill.data.longbench import local_file
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


def local_tasks(
    tasks: list[str], data_dir: str | os.PathLike | None, out_dir: str | os.PathLike
) -> tuple[dict[str, str], dict[str, str]]:
    """({lm-eval task: the task to run}, {task: digest of its local rows}): LongBench tasks with a file in
    `data_dir` map to a local task definition written under `out_dir` (pass it as lm-eval's include path), every
    other task to itself."""
    if data_dir is None:
        return {t: t for t in tasks}, {}
    import lm_eval  # lazy: only runs with lm-eval tasks import it

    builtin = Path(lm_eval.__file__).parent / "tasks" / "longbench"
    out = Path(out_dir)
    names, digests = {}, {}
    for task in tasks:
        config = longbench_config(task)
        path = local_file(data_dir, "longbench", config) if config else None
        if path is None or not path.exists() or not (builtin / f"{config}.yaml").exists():
            names[task] = task
            continue
        names[task] = LOCAL_PREFIX + task
        digests[task] = store.digest(path.read_text())
        definition = (
            f"include: {builtin / f'{config}.yaml'}\n"
            f"task: {LOCAL_PREFIX + task}\n"
            "tag: []\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    test: {Path(path).resolve()}\n"
            "test_split: test\n"
            "process_docs: !function local_docs.hub_schema\n"
        )
        write_text(out / f"{LOCAL_PREFIX + task}.yaml", definition)
    if any(n != t for t, n in names.items()):
        write_text(out / "local_docs.py", _DOCS)
    return names, digests


def task_name(run_name: str) -> str:
    """The task a run reports: a local task under its lm-eval name."""
    return run_name.removeprefix(LOCAL_PREFIX)
