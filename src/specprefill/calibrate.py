"""`specprefill calibrate`: choose, for one (speculator, base) pair, the speculator's layers to run and the (layer,
head) pairs that score, on generated prompts, and save the choice for `calibrated:S` (`models.calibration`).

The steps, each a plain function:
1. `calibration_prompts`: RULER-style prompts made here (single/multi-key/multi-value/multi-query needles, a
   variable-tracking chain, a QA analogue) under a seed space of their own, with the tokens that carry each answer;
2. `head_importance`: every speculator head's own importance over each prompt, moved onto the base's tokens, and the
   base's importance over all of its heads (the target);
3. `search`: for every cut K (layers 0..K-1) a head set chosen greedily among the best-ranked heads below it, scored
   by needle recall after selection and top-k agreement with the base; the shortest cut within `tolerance` of the
   best recall wins.

With look-ahead 1 (a cut model has no language-model head worth using) and max over heads, a set's importance is
the element-wise max of its heads' importances, so every candidate set is scored without running a model again."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from specprefill import core, models, tokenmap
from specprefill.atomic import write_text
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.data import ruler
from specprefill.engines import scoring
from specprefill.errors import SpecPrefillError
from specprefill.settings import CalibrationSettings

TASKS = ("niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt", "qa_1")
SEED_SPACE = 7_000_000  # calibration rows are drawn at seeds SEED_SPACE + seed: the notebooks evaluate at small seeds
POOL = 24  # best-ranked heads below a cut that the greedy selection chooses among


@dataclasses.dataclass
class Prompt:
    task: str
    ids: list[int]  # base tokens
    needle: torch.Tensor  # [M] bool: the base tokens that carry an answer


def answer_mask(text: str, answers: list[str], offsets: list[tuple[int, int]]) -> torch.Tensor:
    """The tokens (by their character offsets) that overlap any occurrence of any answer in `text`."""
    spans = []
    for answer in answers:
        start = text.find(answer)
        while answer and start >= 0:
            spans.append((start, start + len(answer)))
            start = text.find(answer, start + 1)
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    for i, (a, b) in enumerate(offsets):
        mask[i] = any(a < e and s < b for s, e in spans)
    return mask


def calibration_prompts(tokenizer, n: int, length: int, seed: int) -> list[Prompt]:
    """n prompts of at most `length` base tokens, the tasks taken in turn; each keeps only prompts whose answer
    occurs in its text (a QA answer may be paraphrased)."""
    if not getattr(tokenizer, "is_fast", False):
        raise SpecPrefillError("calibration needs the base's fast tokenizer (character offsets): save it with one")
    out: list[Prompt] = []
    counts = {task: len(range(i, n, len(TASKS))) for i, task in enumerate(TASKS)}  # the tasks in turn, n in all
    rows = {t: ruler.generate(t, tokenizer, length, c, seed=SEED_SPACE + seed) for t, c in counts.items() if c}
    for i in range(max(counts.values())):
        for task in TASKS:
            if i >= counts[task]:
                continue
            row = rows[task][i]
            enc = tokenizer(row["input"], return_offsets_mapping=True)
            needle = answer_mask(row["input"], [str(a) for a in row["outputs"]], enc["offset_mapping"])
            if bool(needle.any()):
                out.append(Prompt(task, list(enc["input_ids"]), needle))
    return out


def head_importance(scorer, base_tokenizer, prompt: Prompt, config: SpecPrefillConfig) -> tuple[torch.Tensor, int]:
    """[L*H, M]: each speculator head's importance over the prompt on the base's tokens (row l*H + h), and H."""
    pair = tokenmap.Pair(scorer.tokenizer, base_tokenizer)
    tmap = pair.map(prompt.ids)
    cache = scorer(pair.speculator_ids(prompt.ids, tmap))
    n_layers, n_heads = cache.scores.shape[:2]
    rows = []
    for layer in range(n_layers):
        for head in range(n_heads):
            imp = cache.importance(config.replace(score_heads=f"{layer}.{head}"))
            rows.append(imp if tmap is None else tmap.project(imp, config.cross_token_agg))
    return torch.stack(rows), n_heads


def set_metrics(rows: torch.Tensor, prompts: list[Prompt], per_head: list[torch.Tensor], base: list[torch.Tensor],
                config: SpecPrefillConfig) -> tuple[float, float]:  # fmt: skip
    """Mean needle recall (answer tokens kept / answer tokens) and mean top-k Jaccard with the base's importance of
    the head set `rows` (indices into each prompt's [L*H, M])."""
    recall = jaccard = 0.0
    for p, heads, target in zip(prompts, per_head, base):
        imp = heads[rows].amax(0)
        kept = torch.zeros(len(p.ids), dtype=torch.bool)
        kept[core.select(imp, config)] = True
        recall += float((kept & p.needle).sum()) / float(p.needle.sum())
        jaccard += core.top_k_jaccard(imp, target, core.n_to_keep(len(p.ids), config.keep_rate))
    return recall / len(prompts), jaccard / len(prompts)


def search(per_head: list[torch.Tensor], base: list[torch.Tensor], prompts: list[Prompt], n_heads: int,
           config: SpecPrefillConfig, settings: CalibrationSettings) -> dict:  # fmt: skip
    """The cut and head set. Heads are ranked by their own needle recall (then agreement); under every cut K, a
    greedy forward selection among the POOL best-ranked heads below K adds the head that raises the set's recall
    most (then agreement) while it still does, up to `max_heads`. The shortest cut whose set is within `tolerance`
    of the best recall found wins (then higher recall + agreement, then fewer heads)."""
    n_rows = per_head[0].shape[0]

    def metrics(rows: list[int]) -> tuple[float, float]:
        return set_metrics(torch.tensor(sorted(rows)), prompts, per_head, base, config)

    single = [metrics([r]) for r in range(n_rows)]
    order = sorted(range(n_rows), key=lambda r: (-single[r][0], -single[r][1], r))
    candidates: list[dict[str, Any]] = []
    done: dict[tuple[int, ...], dict[str, Any]] = {}
    for k in range(1, n_rows // n_heads + 1):
        pool = tuple(r for r in order if r // n_heads < k)[:POOL]
        if pool not in done:  # a cut that adds no well-ranked head selects what the shorter one did
            chosen: list[int] = []
            best = (-1.0, -1.0)
            while len(chosen) < min(settings.max_heads, len(pool)):
                score, head = max((metrics([*chosen, r]), r) for r in pool if r not in chosen)
                if score <= best:
                    break
                chosen, best = [*chosen, head], score
            done[pool] = {"heads": len(chosen), "recall": best[0], "jaccard": best[1], "rows": sorted(chosen)}
        candidates.append({"layers": k, **done[pool]})
    top = max(c["recall"] for c in candidates)
    ok = [c for c in candidates if c["recall"] >= top - settings.tolerance]
    chosen_set = min(ok, key=lambda c: (c["layers"], -(c["recall"] + c["jaccard"]), c["heads"]))
    chosen_set = {**chosen_set, "layers": max(r // n_heads for r in chosen_set["rows"]) + 1}  # cut at its last head
    heads = ",".join(f"{r // n_heads}.{r % n_heads}" for r in chosen_set["rows"])
    return {"chosen": chosen_set, "score_heads": heads, "best_recall": top, "candidates": candidates}


def _progress(items: list, desc: str, shown: bool):
    """`items` with a progress bar on standard error (done/total, rate, time left) when `shown`."""
    return tqdm(items, desc=desc, unit="prompt", disable=not shown)


def calibrate(speculator: str, base: str, settings: CalibrationSettings, engine: str = "vllm",
              params: EngineParams | None = None, progress: bool = True) -> dict:  # fmt: skip
    """Run the three steps and save the choice where `calibrated:<speculator>` finds it (the scoring steps show
    their progress unless `progress` is False). Returns what was saved."""
    t0 = time.perf_counter()
    spec_path, base_path = models.resolve_speculator(speculator, base), models.resolve(base)
    config = SpecPrefillConfig(keep_rate=settings.keep_rate, look_ahead=1)
    params = params or EngineParams(speculator=speculator, base=base)
    base_scorer = scoring.open_scorer(
        base_path, engine, 1, scoring.capture_params(params, base_path, "base"), settings.length
    )
    try:
        prompts = calibration_prompts(
            base_scorer.tokenizer, settings.prompts, settings.length, settings.calibration_seed
        )
        base_imp = [
            base_scorer(p.ids).importance(config.replace(score_heads="all"))
            for p in _progress(prompts, "calibrate: scoring the base", progress)
        ]
    finally:
        base_scorer.close()
    spec_scorer = scoring.open_scorer(
        spec_path, engine, 1, scoring.capture_params(params, spec_path, "speculator"), 2 * settings.length
    )
    try:
        per_head, n_heads = [], 0
        for p in _progress(prompts, "calibrate: scoring every speculator head", progress):
            rows, n_heads = head_importance(spec_scorer, base_scorer.tokenizer, p, config)
            per_head.append(rows)
    finally:
        spec_scorer.close()
    found = search(per_head, base_imp, prompts, n_heads, config, settings)
    every = torch.arange(per_head[0].shape[0])
    recall_all, jaccard_all = set_metrics(every, prompts, per_head, base_imp, config)
    chosen = found["chosen"]
    result = {
        "speculator": speculator,
        "base": base,
        "speculator_model": models.fingerprint(spec_path),
        "base_model": models.fingerprint(base_path),
        "layers": chosen["layers"],
        "of_layers": per_head[0].shape[0] // n_heads,
        "score_heads": found["score_heads"],
        "recall": round(chosen["recall"], 4),
        "jaccard": round(chosen["jaccard"], 4),
        "all_heads": {"recall": round(recall_all, 4), "jaccard": round(jaccard_all, 4)},
        "best_recall": round(found["best_recall"], 4),
        "settings": dataclasses.asdict(settings),
        "engine": engine,
        "tasks": sorted({p.task for p in prompts}),
        "prompts": len(prompts),
        "seconds": round(time.perf_counter() - t0, 1),
        "candidates": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items() if k != "rows"}
            for c in found["candidates"]
        ],  # fmt: skip
    }
    path = models.calibration_path(spec_path, base_path)
    write_text(path, json.dumps(result, indent=1))
    return {**result, "path": str(path)}


def ensure(speculator: str, base: str, engine: str = "vllm", params: EngineParams | None = None) -> dict | None:
    """For a `calibrated:S` speculator: its saved calibration for `base`, made now (default settings) when there is
    none; None for any other speculator. What notebook 10 calls before it builds a calibrated pair."""
    if not speculator.startswith(models.CALIBRATED_PREFIX):
        return None
    name = speculator[len(models.CALIBRATED_PREFIX) :]
    path = models.calibration_path(models.resolve_speculator(name, base), models.resolve(base))
    settings = CalibrationSettings()
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("settings") == dataclasses.asdict(settings) and saved.get("engine") == engine:
            return saved
    return calibrate(name, base, settings, engine, params)  # none yet, or one made with other settings: redone


def summary(result: dict) -> str:
    """What the command prints: the cut, the heads, and recall/agreement beside scoring every head."""
    heads = result["score_heads"].split(",")
    return "\n".join(
        [
            f"calibrated {result['speculator']} for base {result['base']} in {result['seconds']:.0f} s "
            f"({result['prompts']} prompts of <= {result['settings']['length']} tokens, keep "
            f"{result['settings']['keep_rate']:g}, seed {result['settings']['calibration_seed']})",
            f"  cut after layer {result['layers'] - 1} ({result['layers']} of {result['of_layers']} layers), "
            f"{len(heads)} heads: {', '.join(heads[:12])}{' ...' if len(heads) > 12 else ''}",
            f"  needle recall {result['recall']:.3f} (all heads of all layers: {result['all_heads']['recall']:.3f}), "
            f"top-k Jaccard with the base {result['jaccard']:.3f} (all heads: {result['all_heads']['jaccard']:.3f})",
            f"  saved {result['path']}; use --speculator calibrated:{result['speculator']} --base {result['base']}",
        ]
    )
