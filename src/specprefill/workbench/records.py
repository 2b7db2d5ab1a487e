"""What the notebooks feed the experiments: records per task from the datasets, and the variants (method, keep rate,
config overrides) to run on them."""

from __future__ import annotations

from specprefill.config import SELECTION_RULES
from specprefill.data import followup, keyed, longbench, natural, realfiles, ruler, shapes, userprompts
from specprefill.data.tasks import short_task
from specprefill.errors import SpecPrefillError


def long_context_records(
    dataset: str,
    tokenizer,
    length: int,
    n: int,
    tasks: list[str],
    data_dir: str | None = None,
    seed: int = 0,
    questions_per_document: int = 1,
) -> dict[str, list[dict]]:
    """ "natural_qa": real SQuAD paragraphs assembled into n documents, `questions_per_document` questions asked of
    each (`data.natural`); "analogue": offline multi-document QA built from SQuAD, one question per document
    (labelled analogue); "longbench": the hub tasks in our own prompts; "lm_eval": none here, the notebook's
    `lm_eval_tasks` run through lm-evaluation-harness instead; a keyed-record task (`data.keyed.TASKS`): its
    generated documents, the same records `ruler_records` gives."""
    if questions_per_document != 1 and dataset != natural.TASK:
        raise SpecPrefillError(
            f"questions_per_document applies to {natural.TASK} only: set it to 1 for {dataset!r}, or use {natural.TASK}"
        )
    if dataset == natural.TASK:
        return {natural.TASK: natural.generate(tokenizer, length, n, questions_per_document, seed)}
    if dataset == "lm_eval":
        return {}
    if dataset == "analogue":
        return {"mdqa_squad_analogue": longbench.analogue(tokenizer, length, n, seed)}
    if dataset == "longbench":
        return {t: longbench.longbench(t, n, data_dir) for t in tasks}
    if dataset in keyed.TASKS:
        return ruler_records(tokenizer, [dataset], length, n, seed)
    raise SpecPrefillError(
        f"dataset {dataset!r} is unknown: use {natural.TASK}, analogue, longbench, lm_eval or a keyed task "
        f"({', '.join(keyed.TASKS)})"
    )


SHAPE_GROUPS = {
    "shapes:tune": shapes.TUNE_CELLS,
    "shapes:report": shapes.REPORT_CELLS,
    "files:tune": realfiles.TUNE_CELLS,
    "files:report": realfiles.REPORT_CELLS,
    "files:report-formats": realfiles.REPORT_FORMATS,
    "files:report-turns": realfiles.REPORT_TURNS,
}


def expand_tasks(tasks: list[str]) -> list[str]:
    """Task names with the groups ("shapes:tune", "shapes:report", "files:tune", "files:report") spelled out."""
    return [cell for t in tasks for cell in SHAPE_GROUPS.get(t, [t])]


def ruler_records(tokenizer, tasks: list[str], length: int, n: int, seed: int = 0) -> dict[str, list[dict]]:
    """RULER's tasks, the keyed-record tasks (`data.keyed.TASKS`), the document shapes (`data.shapes`: a cell
    `shape:<shape>/<position>/<line ends>/<kind>` or a group `shapes:tune`/`shapes:report`) and the real-file
    questions (`data.realfiles`: `file:<kind>...` or `files:tune`/`files:report`), by name."""
    out = {}
    for t in expand_tasks(tasks):
        prefixed = {shapes.PREFIX: shapes, realfiles.PREFIX: realfiles}
        module = keyed if t in keyed.TASKS else next((m for p, m in prefixed.items() if t.startswith(p)), ruler)
        out[t] = module.generate(t, tokenizer, length, n, seed)
    return out


def task_records(
    tokenizer,
    tasks: list[str],
    length: int,
    n: int,
    seed: int = 0,
    questions_per_document: int = 1,
    data_dir: str | None = None,
) -> dict[str, list[dict]]:
    """Any task by name, at one length: natural-text QA (`data.natural`, with `questions_per_document`), the
    follow-up turn (`data.followup`), the long-QA analogue, RULER's tasks, the keyed records, the document shapes
    (cells or groups, `ruler_records`), and LongBench's tasks in the project's prompts from `data_dir` (cut to
    `length` in the middle)."""
    out: dict[str, list[dict]] = {}
    for t in tasks:
        if t in longbench.LONGBENCH:  # cut to the length as LongBench's own prediction script cuts (the middle)
            rows = longbench.longbench(t, n, data_dir)
            out[t] = [{**r, "input": longbench.truncate_middle(tokenizer, r["input"], length)} for r in rows]
        elif t in (natural.TASK, "analogue"):
            per_doc = questions_per_document if t == natural.TASK else 1
            out |= long_context_records(t, tokenizer, length, n, [], seed=seed, questions_per_document=per_doc)
        elif t == followup.TASK:
            out[t] = followup.generate(tokenizer, length, n, seed)
        elif t.startswith(userprompts.PREFIX):  # a group of the user's own prompts file
            out[t] = userprompts.generate(t, tokenizer, length, n, seed)
        else:
            out |= ruler_records(tokenizer, [t], length, n, seed)
    return out


def check_tasks(tasks: list[str]) -> None:
    """That `task_records` knows every name, before any model or data is loaded (one line naming the kinds)."""
    for t in tasks:
        if t.startswith(shapes.PREFIX):
            shapes.parse(t)
        elif t.startswith(realfiles.PREFIX):
            realfiles.parse(t)
        elif t.startswith(userprompts.PREFIX):
            userprompts.parse(t)
        elif t not in (natural.TASK, "analogue", followup.TASK, *longbench.LONGBENCH, *keyed.TASKS, *SHAPE_GROUPS,
                       *ruler.ALL_TASKS):  # fmt: skip
            raise SpecPrefillError(
                f"task {t!r} is unknown: use {natural.TASK}, {followup.TASK}, analogue, a RULER task "
                f"({', '.join(ruler.ALL_TASKS)}), a keyed task ({', '.join(keyed.TASKS)}), a shape cell or group "
                f"({', '.join(SHAPE_GROUPS)}) or a LongBench task (e.g. hotpotqa)"
            )


def ruler_and_long_qa(tokenizer, tasks: list[str], length: int, n: int, long_qa: bool, seed: int = 0) -> dict:
    """RULER tasks, plus (with `long_qa`) the long-QA analogue of notebook 01 at the same length."""
    records = ruler_records(tokenizer, tasks, length, n, seed)
    return records | (long_context_records("analogue", tokenizer, length, n, [], seed=seed) if long_qa else {})


def short_records(tasks: dict[str, int]) -> dict[str, list[dict]]:
    return {name: short_task(name, n) for name, n in tasks.items()}


# The original repository's configuration families (its configs/config_p{K}*): SpecPrefill knobs per family; a
# variant "p_full_lah8" at keep rate 0.1 is the original's p1_full_lah8.
FAMILIES: dict[str, dict] = {
    "p": {"chunk_size": 0, "pool_kernel": 0, "look_ahead": 1},  # token-level, look-ahead 1, no pooling
    "p_full": {"chunk_size": 32, "pool_kernel": 13, "look_ahead": 1},  # chunks of 32, average pool 13
    "p_full_lah4": {"chunk_size": 32, "pool_kernel": 13, "look_ahead": 4},
    "p_full_lah8": {"chunk_size": 32, "pool_kernel": 13, "look_ahead": 8},
}
# what `bench ttft --families` takes: the families, and the selection rules (`config.SELECTION_RULES`) by name with
# the bench's scoring knobs kept (`--families chunks,records+protect+query`: the original's chunks and the serving
# default timed side by side)
TIMING_FAMILIES: dict[str, dict] = {**FAMILIES, **SELECTION_RULES}


def variants(
    keep_rates: list[float],
    methods: tuple[str, ...] = ("specprefill",),
    full: bool = True,
    extra: list[dict] | None = None,
    families: list[str] | tuple[str, ...] = (),
) -> list[dict]:
    """[full] + every method at every keep rate + extra variants (dicts with "method", "label", overrides). With
    `families` (names in `FAMILIES`), SpecPrefill runs once per family and keep rate, labelled by the family, with the
    family's knobs over the notebook's; without, once with the notebook's knobs, labelled "specprefill"."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SpecPrefillError(f"families {unknown} are unknown: use names from {', '.join(FAMILIES)}")
    out = [{"method": "full", "label": "full", "keep_rate": 1.0}] if full else []
    for m in methods:
        if m == "specprefill" and families:
            out += [{"method": m, "label": f, "keep_rate": r, **FAMILIES[f]} for f in families for r in keep_rates]
        else:
            out += [{"method": m, "label": m, "keep_rate": r} for r in keep_rates]
    return out + list(extra or [])


def rule_variants(rules: list[str], keep_rates: list[float]) -> list[dict]:
    """SpecPrefill under each selection rule of `config.SELECTION_RULES` at every keep rate, labelled by the rule:
    the extra rows beside the original's selection."""
    unknown = [r for r in rules if r not in SELECTION_RULES]
    if unknown:
        raise SpecPrefillError(f"selection rules {unknown} are unknown: use names from {', '.join(SELECTION_RULES)}")
    return [
        {"method": "specprefill", "label": r, "keep_rate": p, **SELECTION_RULES[r]} for r in rules for p in keep_rates
    ]


def ablation_variants(ablations: list[dict], keep_rate: float) -> list[dict]:
    """SpecPrefill at one keep rate, one variant per ablation dict ({"label", **config overrides})."""
    return [{"method": "specprefill", "keep_rate": keep_rate, **a} for a in ablations]


def texts(records_by_task: dict[str, list[dict]]) -> list[str]:
    return [r["input"] for records in records_by_task.values() for r in records]
