"""How many paired prompts a quality cell needs under the report's verdict rule (`stats.verdict`, set before the
data), found by simulating that rule: full prefill and a pruned setting answer the same n prompts, 0/1 each; full
prefill is right on a share `p_full` of prompts and the two disagree on a share `q` (the discordant pairs); each
simulated run's interval is the rule's own (`stats.newcombe`). Per n:
- `n_for_no_difference`: the smallest n at which, with no true difference, the interval lies within +-`MARGIN`
  points in at least `POWER` of runs (the rule says "no difference found");
- `detectable`: the smallest true drop the rule calls "lower" in at least `POWER` of runs at n.
Planning values: a pilot's discordant share (`stats.summarize`'s `discordant`) or `PLAN_Q` / `PLAN_P_FULL`, stated
where printed.
"""

from __future__ import annotations

import functools
import math
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from specprefill.errors import SpecPrefillError
from specprefill.workbench import stats

POWER = 0.8
# planned to POWER + CUSHION of simulated runs: their noise and the interval's steps between neighbouring n stay above
CUSHION = 0.05
REPS = 2000
PLAN_Q = 0.2  # discordant share assumed without a pilot (the 2k selection tables: 0.0-0.3 at keep 0.1-0.3)
PLAN_P_FULL = 0.8  # full prefill's share right, assumed without a pilot


def _margin() -> float:
    return stats.MARGIN / stats.SCALE


def share(n: int, q: float, drop: float = 0.0, p_full: float = PLAN_P_FULL, reps: int = REPS, seed: int = 0) -> dict:
    """Share of simulated runs of n pairs the rule calls "lower" and "no difference found", when the pruned setting
    is right `drop` less often than full prefill (a share) and the two disagree on a share `q` of prompts (on `drop`
    where that is larger)."""
    # pruned right & full wrong (none once the drop exceeds q; at most the prompts full prefill gets wrong)
    better = min(max(0.0, (q - drop) / 2), max(0.0, 1 - p_full))
    worse = better + drop  # full right & pruned wrong
    probs = [p_full - worse, worse, better, 1 - p_full - better]  # both right, full only, pruned only, neither
    if n < 1 or min(probs) < -1e-12 or drop < 0:
        raise SpecPrefillError(
            f"no such paired outcome: n={n}, q={q}, drop={drop}, p_full={p_full} (need drop >= 0 and drop + "
            "discordant pairs within what full prefill gets right)"
        )
    counts = np.random.default_rng(seed).multinomial(n, np.clip(probs, 0, None), size=reps)
    lower = same = 0
    m = _margin()
    for both, full_only, pruned_only, _ in counts.tolist():
        _, low, high = stats.newcombe(both, pruned_only, full_only, n)  # pruned - full
        lower += high < 0
        same += -m <= low and high <= m
    return {"lower": lower / reps, "no difference found": same / reps}


@functools.lru_cache(maxsize=256)
def n_for_no_difference(q: float = PLAN_Q, p_full: float = PLAN_P_FULL) -> int:
    """The smallest n at which, with no true difference, "no difference found" in POWER (+ CUSHION) of runs."""
    z = stats.Z + statistics.NormalDist().inv_cdf(0.5 + POWER / 2)
    guess = max(2, math.ceil(q * (z / _margin()) ** 2))  # the normal approximation: a start
    ok = lambda n: share(n, q, 0.0, p_full)["no difference found"] >= POWER + CUSHION  # noqa: E731
    lo, hi = 1, guess  # lo: one pair never decides; the simulated shares may need far fewer than the guess
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, hi // 100):  # to 1%: the search, not the simulation, sets the last digit
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


@functools.lru_cache(maxsize=256)
def detectable(n: int, q: float = PLAN_Q, p_full: float = PLAN_P_FULL) -> float | None:
    """The smallest true drop (points) the rule calls "lower" in POWER (+ CUSHION) of runs of n pairs (discordant
    share q, or the drop where larger: every disagreement a loss); None when not even losing every prompt full
    prefill gets right is."""
    ok = lambda d: share(n, q, d, p_full)["lower"] >= POWER + CUSHION  # noqa: E731
    if not ok(p_full):
        return None
    lo, hi = 0.0, p_full
    while hi - lo > 0.0025:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return round(hi * stats.SCALE, 1)


def cells(params: dict) -> list[int]:
    """The n of each quality cell a notebook's parameters ask for (empty: not a notebook that scores answers against
    full prefill's: no keep rate or no answers generated)."""
    if not ({"keep_rates", "keep_rate"} & set(params)) or "max_tokens" not in params:
        return []
    if isinstance(params.get("n_samples"), int):
        return [params["n_samples"]]
    tasks = params.get("tasks")
    return sorted({int(v) for v in tasks.values()}) if isinstance(tasks, dict) else []


PLANNING = Path(__file__).resolve().parents[1] / "data" / "files" / "planning.yaml"


def planning(task: str, length: int | None) -> tuple[float, float, str]:
    """(q, p_full, where from) for a task at a prompt length: a pilot's (`data/files/planning.yaml`), else the
    assumed `PLAN_Q` / `PLAN_P_FULL`."""
    pilots = (yaml.safe_load(PLANNING.read_text()) or {}).get(task, {})
    pilot = pilots.get(length) or (pilots.get(None) if None in pilots else None)
    if pilot:
        return float(pilot["q"]), float(pilot["p_full"]), f"pilot: {pilot['source']}"
    return PLAN_Q, PLAN_P_FULL, "assumed, no pilot"


def plan_line(name: str, params: dict) -> str | None:
    """One line per task for `reproduce --prepare-only`: n per cell, the smallest drop it can call "lower", and the
    n that "no difference found" needs, at the task's planning values (`planning`, stated)."""
    ns = cells(params)
    if not ns:
        return None
    tasks = params.get("tasks")
    per_task = (
        {t: int(n) for t, n in tasks.items()}
        if isinstance(tasks, dict)
        else {t: ns[0] for t in (tasks if isinstance(tasks, list) else [params.get("dataset", "task")])}
    )
    length = params.get("length")
    lines = []
    k = int(params.get("questions_per_document", 1))
    for task, n in per_task.items():
        q, p, source = planning(task, length)
        said_n = f"{n}" if k == 1 else f"{n * k} ({n} documents x {k} questions, planned as independent questions)"
        n *= k
        drop = detectable(n, q, p)
        said = "none" if drop is None else f"{drop:g} points"
        same = round(min(q, 2 * (1 - p)), 3)  # without a difference, pruned-only wins balance full-only ones
        need = n_for_no_difference(same, p)
        need_said = f"{need}" if k == 1 else f"{need} questions (~{math.ceil(need / k)} documents of {k})"
        lines.append(
            f"{name} {task}: n = {said_n} per cell calls a drop of {said} lower at 80% power; 'no difference found' "
            f"(+-{stats.MARGIN:g}) needs n = {need_said} (planning: full right on {p:g}, {q:g} of pairs discordant, "
            f"{same:g} without a difference; {source})"
            + (
                "; the run's interval counts documents: questions that share a document's difficulty need more"
                if k > 1
                else ""
            )
        )
    return "\n  ".join(lines)


def needed(cells: pd.DataFrame, full_scores: dict) -> int | None:
    """The n per cell at which the undecided `cells` (summary rows) would be decided "no difference found" were
    there none: from each pilot's discordant share and full prefill's score on its task (a 0-100 metric without
    0/1 pairs: the normal approximation from its interval's width); the largest over cells."""
    z, z_two = stats.Z, statistics.NormalDist().inv_cdf(0.5 + POWER / 2)
    out = []
    for row in cells.to_dict("records"):
        q = row.get("discordant")
        if q is not None and q == q:
            q = min(1.0, math.ceil(max(q, 0.05) * 20) / 20)  # a 0.05 grid: pilots of a few prompts are coarse
            p = round(full_scores.get(row.get("task"), 50.0) / stats.SCALE, 2)
            out.append(n_for_no_difference(q, min(max(p, q / 2), 1 - q / 2)))  # shares that can occur with q
        elif row.get("diff_high", math.nan) == row.get("diff_high") and row.get("n"):
            half = (row["diff_high"] - row["diff_low"]) / 2
            out.append(math.ceil(row["n"] * (half * (z + z_two) / (z * stats.MARGIN)) ** 2))
    return max(out) if out else None
