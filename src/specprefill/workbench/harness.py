"""How the paper's quality protocol runs lm-evaluation-harness tasks: which tasks get the model's chat template (as
the original did), per-task settings, and where their data comes from (the hub, or a local directory in the hub's
own schema).

- Chat template: with `chat_template=True` every task runs through the model's chat template, few-shot examples as
  a multi-turn conversation (lm-eval's `apply_chat_template` + `fewshot_as_multiturn`), except LongBench's trec,
  triviaqa, samsum, lsht, lcc and repobench-p (and their LongBench-E twins), which LongBench's own prediction script
  leaves untemplated, and tasks whose `task_args` say otherwise.
- Per-task settings (`task_args`: chat_template, num_fewshot, max_gen_toks): tasks are run in groups sharing them
  (`run_groups`), e.g. generative MMLU zero-shot without the template and GPQA 8-shot as the original scripts did.
- Local data: `local_tasks` writes, for every task (every member of a group), a task definition that is lm-eval's
  own (prompt, few-shot, generation settings, metric, via `include`) reading `DIR/<dataset>/<config>.jsonl` instead
  of the hub; RULER's generated rows are read from `DIR/ruler/<task>.jsonl` instead of being generated.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from specprefill.atomic import write_bytes, write_text
from specprefill.cache import cache_dir
from specprefill.data import longbench
from specprefill.errors import SpecPrefillError
from specprefill.workbench import store

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")  # the project's own lm-eval tasks (EvalPlus's HumanEval+/MBPP+)
CODE_TASKS = ("evalplus_humaneval", "evalplus_mbpp")  # run model-written code: in the sandbox, rows say which boundary


def tasks_digest() -> str:
    """A digest of the project's own task definitions (prompts, stops, scoring): in the key of every unit that runs
    them, so editing one computes those units again."""
    return store.digest({str(f.relative_to(TASKS_DIR)): f.read_text() for f in sorted(TASKS_DIR.rglob("*"))
                         if store.is_definition(f)})  # fmt: skip


def include_paths(*paths: str | os.PathLike | None) -> list[str]:
    """lm-eval's include path: the project's own tasks, then the given directories (the user's, the local ones)."""
    return [str(TASKS_DIR)] + [str(p) for p in paths if p]


LONGBENCH_UNTEMPLATED = longbench.UNTEMPLATED
LOCAL_PREFIX = "local_"  # a task read from the data directory is named local_<task>; rows carry <task>


def longbench_config(task: str) -> str | None:
    """LongBench's config name of an lm-eval task (`longbench_hotpotqa_e` -> `hotpotqa_e`), None for other tasks."""
    return task.removeprefix("longbench_") if task.startswith("longbench_") else None


# what a protocol may set per lm-eval task; `filter`: the filter whose answers are scored (default: the task's first)
TASK_ARGS = ("chat_template", "num_fewshot", "max_gen_toks", "filter")


def check_task_args(tasks: list[str], task_args: dict | None) -> dict[str, dict]:
    """`task_args` ({task: {chat_template, num_fewshot, max_gen_toks, filter}}) checked against the protocol's
    tasks."""
    task_args = dict(task_args or {})
    for task, args in task_args.items():
        if task not in tasks:
            raise SpecPrefillError(
                f"lm_eval_task_args names {task!r}, not one of lm_eval_tasks: fix the name or add the task"
            )
        unknown = sorted(set(args or {}) - set(TASK_ARGS))
        if unknown:
            raise SpecPrefillError(
                f"lm_eval_task_args[{task!r}]: unknown {', '.join(unknown)}; use {', '.join(TASK_ARGS)}"
            )
    return {t: dict(a or {}) for t, a in task_args.items()}


def uses_chat_template(task: str, chat_template: bool, task_args: dict | None = None) -> bool:
    """Whether `task` runs through the chat template: its own `chat_template` in `task_args` where given, else the
    protocol's (`chat_template`) but for LongBench's untemplated tasks."""
    own = ((task_args or {}).get(task) or {}).get("chat_template")
    if own is not None:
        return bool(own)
    config = longbench_config(task)
    return chat_template and (config is None or config.removesuffix("_e") not in LONGBENCH_UNTEMPLATED)


TRUNCATION = ("left", "middle", "right")  # which part of a prompt longer than the context lm-eval cuts


def check_truncation(truncation: str) -> str:
    if truncation not in TRUNCATION:
        raise SpecPrefillError(f"lm_eval_truncation {truncation!r}: use {', '.join(TRUNCATION[:-1])} or right")
    return truncation


def run_groups(
    tasks: list[str], chat_template: bool, task_args: dict | None = None, max_gen_toks: int | None = None
) -> dict[tuple[bool, int | None, int | None], list[str]]:
    """Tasks grouped by how lm-eval runs them, one run per group: (chat template, few-shot count or None for the
    task's own, cap on answer tokens or None: the smaller of the task's `max_gen_toks` and the profile's)."""
    task_args = task_args or {}
    groups: dict[tuple[bool, int | None, int | None], list[str]] = {}
    for task in tasks:
        args = task_args.get(task) or {}
        caps = [c for c in (args.get("max_gen_toks"), max_gen_toks) if c]
        key = (uses_chat_template(task, chat_template, task_args), args.get("num_fewshot"), min(caps) if caps else None)
        groups.setdefault(key, []).append(task)
    return groups


_DOCS = '''"""Written by specprefill: LongBench rows in the hub's schema, as lm-eval's copy of LongBench reads them."""


def hub_schema(dataset):
    if "question" in dataset.column_names:
        return dataset
    return dataset.map(lambda doc: {"question": doc.get("input", "")})
'''
SPLITS = ("test_split", "validation_split", "training_split", "fewshot_split")


def dataset_location(task: str, cfg: dict, yaml_path: str | os.PathLike) -> tuple[str, str] | None:
    """(folder, config) of a task's rows in a data directory: a hub dataset is `<last part of its hub path, lower
    case>/<hub config or default>`; a task whose rows lm-eval's own code generates (RULER's `custom_dataset`) is
    `<its task folder>/<task name without that folder's prefix>`, e.g. `ruler/niah_single_1`, `ruler/qa_hotpot`,
    holding the generated rows (`input`, `outputs`, `gen_prefix`, `length`, `max_length`). None: no dataset."""
    if cfg.get("custom_dataset"):
        folder = Path(yaml_path).parent.name
        return folder, task.removeprefix(folder + "_")
    if not cfg.get("dataset_path"):
        return None
    return Path(str(cfg["dataset_path"])).name.lower(), cfg.get("dataset_name") or "default"


def local_files(task: str, cfg: dict, yaml_path, data_dir: str | os.PathLike) -> dict[str, Path] | None:
    """The files of a task's rows in `data_dir`, by split: `DIR/<folder>/<config>.jsonl` (`dataset_location`), or
    `<config>.<split>.jsonl` where a split has its own rows. None when the directory does not hold them."""
    where = dataset_location(task, cfg, yaml_path)
    if where is None:
        return None
    folder, config = Path(data_dir) / where[0], where[1]
    if not (folder / f"{config}.jsonl").exists():
        return None
    splits = {cfg[k] for k in SPLITS if cfg.get(k)}
    return {
        s: next(p for p in (folder / f"{config}.{s}.jsonl", folder / f"{config}.jsonl") if p.exists()) for s in splits
    }


def leaves(task: str | dict, index: dict) -> list[str]:
    """The tasks a task name runs: itself, or a group's member tasks (in definition order; groups defined inline
    included) or a tag's (by name), recursively."""
    if isinstance(task, dict):  # a group defined inline in another (MMLU's categories)
        members = task.get("task", [])
    else:
        entry = index.get(task)
        if entry is None:
            raise SpecPrefillError(f"lm-eval has no task {task!r}: check the name with `lm-eval ls tasks`")
        if entry.kind.name in ("TASK", "PY_TASK"):
            return [task]
        members = entry.cfg.get("task", []) if entry.kind.name == "GROUP" else sorted(entry.tags)  # tags: by name
    return [leaf for m in ([members] if isinstance(members, str) else members) for leaf in leaves(m, index)]


@dataclass
class Tasks:
    """How a protocol's lm-eval tasks run: `run` maps each task to the name lm-eval loads (itself, or the local
    definition reading the data directory); `owner` maps every task lm-eval will report samples for (a group's
    members) to the protocol task it belongs to; `digests`: the local rows' digest by task."""

    run: dict[str, str]
    owner: dict[str, str]
    digests: dict[str, str] = field(default_factory=dict)

    def task_of(self, reported: str) -> str:
        """The protocol task a reported task's samples belong to (a group member -> its group)."""
        return self.owner.get(reported, reported.removeprefix(LOCAL_PREFIX))


def _definition(task: str, yaml_path, files: dict[str, Path], cfg: dict) -> str:
    data_files = "".join(f"    {s}: {p.resolve()}\n" for s, p in sorted(files.items()))
    text = (
        f"include: {yaml_path}\n"
        f"task: {LOCAL_PREFIX + task}\n"
        "tag: []\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n{data_files}"
    )
    if cfg.get("custom_dataset"):  # the generated rows are read, not generated again
        text += "custom_dataset: null\n"
    if longbench_config(task):  # lm-eval's copy of LongBench names the hub's `input` field `question`
        text += "process_docs: !function local_docs.hub_schema\n"
    return text


# IFEval checks that need nltk data packages (lm-eval downloads them on import where the network allows)
IFEVAL_NLTK = {
    "length_constraints:number_sentences": "tokenizers/punkt_tab",  # nltk >= 3.9 loads punkt's tables
    "change_case:capital_word_frequency": "tokenizers/punkt_tab",
}


def check_ifeval_data(task: str, yaml_path, files: dict[str, Path] | None) -> None:
    """An IFEval task scores some instructions with nltk's sentence/word tokenizers: one line naming the fix when
    their data is missing, before any generation (else lm-eval fails while scoring). Local rows: the instructions they
    use; the hub's rows use them all."""
    if Path(yaml_path).parent.name != "ifeval":
        return
    import nltk  # lm-eval's IFEval and RULER need it (the lm-eval extras install it)

    used = set(IFEVAL_NLTK)
    if files:
        rows = [json.loads(line) for f in set(files.values()) for line in f.read_text().splitlines() if line.strip()]
        used = {i for r in rows for i in r.get("instruction_id_list", [])} & set(IFEVAL_NLTK)
    missing = {}
    for instruction in sorted(used):
        try:
            nltk.data.find(IFEVAL_NLTK[instruction])
        except LookupError:
            missing[instruction] = IFEVAL_NLTK[instruction].split("/")[-1]
    if missing:
        packages = sorted(set(missing.values()))
        raise SpecPrefillError(
            f"{task}: the instructions {', '.join(missing)} are scored with nltk's {', '.join(packages)} data, which "
            f"is not installed: run `python -m nltk.downloader {' '.join(packages)}` where the network allows (or "
            "point NLTK_DATA at a copy)"
        )


def _stock_index_key(stock: Path) -> str | None:
    """What lm-eval's own task folder is: where it is (the index holds its paths), its distribution's RECORD (every
    installed file with its hash) and version; None for an editable lm-eval, whose files change without a reinstall
    (its index is then always read)."""
    try:
        dist = importlib.metadata.distribution("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return None
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    record = dist.read_text("RECORD")
    if direct.get("dir_info", {}).get("editable") or not record:
        return None
    return store.digest({"folder": str(stock.resolve()), "version": dist.version, "record": record})


def _read_stock_index(build, stock: Path) -> dict:
    """lm-eval's index of its own task folder, kept on disk beside the project's other caches and keyed by what is
    installed (`_stock_index_key`): read in ~1 s instead of built in ~10 s by each process that plans or runs lm-eval
    tasks. A missing, stale or unreadable copy is built again and replaced (atomically)."""
    key = _stock_index_key(stock)
    path = cache_dir() / "lm_eval" / f"stock-index-{key}.pickle" if key else None
    if path is not None and path.is_file():
        try:
            with path.open("rb") as f:
                return pickle.load(f)
        except Exception:  # a copy another version wrote, or a damaged one: built again below
            pass
    index = build([stock])
    if path is not None:
        try:
            write_bytes(path, pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # a read-only cache folder: the index is still right, only not kept
            pass
    return index


def index_stock_tasks_once() -> None:
    """lm-eval's TaskManager reads every YAML file of lm-eval's own task folder (~11 s here) each time one is built, and
    a run builds several (the plan, the run, each resumed notebook). That folder is part of the installed package, so
    its index is read once per process (from the cache folder when this lm-eval was indexed before) and each
    TaskManager reads only its include paths on top (later paths override earlier ones, as lm-eval merges them); the
    entries are shared read-only (lm-eval's task factory deep-copies an entry's config before building from it)."""
    from lm_eval.tasks import _index  # lazy: only runs with lm-eval tasks import it

    if getattr(_index.TaskIndex, "_specprefill_stock_once", False):
        return
    build, stock, cache = _index.TaskIndex.build, Path(_index.__file__).parent, {}

    def build_once(paths, *, resolve_includes=True):
        paths = [Path(p) for p in paths]
        if not paths or paths[0] != stock or not resolve_includes:
            return build(paths, resolve_includes=resolve_includes)
        if "stock" not in cache:
            cache["stock"] = _read_stock_index(build, stock)
        index = dict(cache["stock"])
        index.update(build(paths[1:]))
        return index

    build_once.lm_eval_build = build  # type: ignore[attr-defined]  # lm-eval's own, for comparison
    _index.TaskIndex.build = staticmethod(build_once)
    _index.TaskIndex._specprefill_stock_once = True


def local_tasks(
    tasks: list[str],
    data_dir: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    include_path: str | None = None,
) -> Tasks:
    """The lm-eval tasks of a protocol, read from `data_dir` when it is given: every task (every member of a group)
    then maps to a definition written under `out_dir` (pass it as lm-eval's include path) that is lm-eval's own
    (`include`: prompt, few-shot, generation settings, metric) reading the directory's rows (`local_files`); a group
    maps to a group of those with lm-eval's aggregation. A task whose rows the directory lacks is an error, never a
    silent read from the hub. `include_path`: the user's own task definitions, as lm-eval's include path."""
    from lm_eval.tasks import TaskManager  # lazy: only runs with lm-eval tasks import it
    from lm_eval.tasks._yaml_loader import load_yaml  # the loader lm-eval's task index uses (includes resolved)

    index_stock_tasks_once()
    index = TaskManager(include_path=include_paths(include_path)).task_index
    members = {t: leaves(t, index) for t in tasks}
    owner = {m: t for t in tasks for m in members[t] if m != t}
    owner.update({LOCAL_PREFIX + m: t for m, t in list(owner.items())})
    if data_dir is None:
        for leaf in (m for t in tasks for m in members[t]):
            check_ifeval_data(leaf, index[leaf].yaml_path, None)
        return Tasks({t: t for t in tasks}, owner)
    out = Path(out_dir)
    run, digests, missing, definitions = {}, {}, [], {}
    for task in tasks:
        texts = {}
        for leaf in members[task]:
            entry = index[leaf]
            if entry.kind.name != "TASK":
                raise SpecPrefillError(f"{leaf} is defined by a Python class: it cannot read rows from {data_dir}")
            cfg = load_yaml(entry.yaml_path, resolve_func=False)
            files = local_files(leaf, cfg, entry.yaml_path, data_dir)
            if not files:
                where = dataset_location(leaf, cfg, entry.yaml_path)
                missing.append(f"{leaf} ({'/'.join(where) + '.jsonl' if where else 'no dataset to read'})")
                continue
            check_ifeval_data(leaf, entry.yaml_path, files)
            texts[leaf] = {s: p.read_text() for s, p in sorted(files.items())}
            definitions[f"{LOCAL_PREFIX + leaf}.yaml"] = _definition(leaf, entry.yaml_path, files, cfg)
        run[task] = LOCAL_PREFIX + task
        digests[task] = store.digest(texts)
        if index[task].kind.name != "TASK":  # a group of the local members, aggregated as lm-eval's group is
            group = {
                "group": LOCAL_PREFIX + task,
                "task": [LOCAL_PREFIX + m for m in members[task]],
                "aggregate_metric_list": index[task].cfg.get("aggregate_metric_list", []) if index[task].cfg else [],
                "metadata": {"version": 1},
            }
            definitions[f"{LOCAL_PREFIX + task}.yaml"] = json.dumps(group, indent=1) + "\n"
    if missing:
        raise SpecPrefillError(
            f"the data directory {data_dir} has no rows for {len(missing)} task(s): {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}; add those files or run without a data directory"
        )
    if any(longbench_config(m) for t in tasks for m in members[t]):
        definitions["local_docs.py"] = _DOCS
    for name, text in definitions.items():  # only once every task has its rows: a refused run writes nothing
        write_text(out / name, text)
    return Tasks(run, owner, digests)


def cap_answers(loaded: dict, cap: int, default: int) -> None:
    """Lower every loaded generation task's answer limit to `cap` (never raising it: a task's own `max_gen_toks`,
    else the model's `default`, stays when smaller)."""
    for task in loaded["tasks"].values():
        kwargs = task.config.generation_kwargs
        if task.config.output_type == "generate_until" and kwargs is not None:
            kwargs["max_gen_toks"] = min(int(kwargs.get("max_gen_toks", default)), cap)


def loading_once(manager_class: type) -> type:
    """lm-eval's TaskManager whose `load` builds each list of tasks once (datasets read, documents processed): the
    variants of a protocol run the same tasks one after another, and building 60 tasks (MMLU's subjects) again for
    each would cost more than the small profiles' generation. Safe because every run sets the same per-group
    overrides (few-shot, answer cap) and lm-eval builds each run's requests afresh."""

    class LoadingOnce(manager_class):
        def load(self, task_list):
            if not (isinstance(task_list, list) and all(isinstance(t, str) for t in task_list)):
                return super().load(task_list)
            cache = self.__dict__.setdefault("_specprefill_loaded", {})
            if tuple(task_list) not in cache:
                cache[tuple(task_list)] = super().load(task_list)
            return cache[tuple(task_list)]

    return LoadingOnce
