"""One request's path, decided in one place: what the request carries, what the base holds of its tenant's earlier
requests (`turns.TurnMemory`) and the rates the server measured (`turns.PairTimes`) in; the path, what the base
receives and the reasons in words out (`decide` -> `Decision`). Pure functions: the engines act on the decision
(`engines.vllm.request.plan`), the server shows its reasons under --enable-prompt-tokens-details.

The paths, in the order they are tried:
1. whole, nothing asked of the speculator (`runs_whole`): an empty prompt, one shorter than `min_prompt_tokens`,
   keep rate 1, or sampling that reads every prompt token (prompt log-probs);
2. a request sharing its start with an earlier one of its tenant (`plan_reuse`, on `MIN_SHARED` tokens or more):
   `extend` (the same prompt again, or it plus the start of its own answer: the earlier kept set), `whole` (fewer
   than `max_new` tokens added to a prefix the base holds whole), `append` (`max_new` or more added to an earlier
   pruned turn: its kept set there, the addition selected), `prefix` (a prefix held whole so far: it whole, the rest
   selected) or `speculate` (selected afresh);
3. a `prefix` request runs whole instead where the measured rates predict that no slower (`predict_paths`,
   `cheapest`);
4. everything else is speculated."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specprefill.core.turns import MIN_SHARED, PairTimes, Reuse, TurnMemory


@dataclass(frozen=True)
class Decision:
    """A request's path: `speculate`, or the base gets `reuse.kept` (None reuse and no speculation: the whole
    prompt); `predicted`: seconds per path where paths were weighed; `reasons`: why, one line per step taken."""

    reuse: Reuse | None
    speculate: bool
    reasons: tuple[str, ...]
    predicted: dict[str, float] | None = None


def runs_whole(n_prompt: int, keep_rate: float, min_prompt_tokens: int, params: Any) -> str | None:
    """Why the base gets a prompt whole without asking the speculator (None: it may be pruned): empty, shorter
    than `min_prompt_tokens`, keep rate 1, or asking for prompt log-probs (those are per prompt token: echo with
    logprobs, lm-eval's loglikelihood)."""
    if n_prompt == 0:
        return "whole: the prompt is empty"
    if n_prompt < min_prompt_tokens:
        return f"whole: {n_prompt} tokens, under min_prompt_tokens {min_prompt_tokens}"
    if keep_rate >= 1:
        return "whole: keep rate 1"
    if getattr(params, "prompt_logprobs", None) is not None:
        return "whole: prompt log-probs asked (one per prompt token)"
    return None


def plan_reuse(ids: Sequence[int], memory: TurnMemory, tenant: str = "", max_new: int = 0) -> Reuse | None:
    """How a request uses what the base holds of `tenant`'s earlier requests (None: nothing shared). A request adding
    fewer than `max_new` tokens to a prefix the base holds whole runs whole (0: never); one adding `max_new` or more
    to a prefix held pruned keeps the earlier selection there (`append`, 0: never); one sharing at least
    `MIN_SHARED` tokens the base holds whole gets them whole and the rest selected (`prefix`)."""
    found = memory.find(ids, tenant)
    if found is None:
        return None
    held, length = found
    n = len(ids)
    if length < MIN_SHARED:
        return None
    if length == n and n >= len(held.prompt):  # the same prompt, or it plus the start of its own answer
        return Reuse("extend", length, held.cached(length))
    whole = min(held.held_whole, length)
    if whole == length and n - length < max_new:
        return Reuse("whole", length, np.arange(n, dtype=np.int64))
    if 0 < max_new <= n - length and len(held.prompt) <= length and whole < length:  # a long addition to a turn
        return Reuse("append", length, held.cached(length))
    if whole >= MIN_SHARED:
        return Reuse("prefix", whole, shared=min(length, len(held.prompt)))  # the speculator never read the answer
    return Reuse("speculate", length)


def explain(reuse: Reuse | None, n: int, max_new: int) -> str:
    """`plan_reuse`'s answer in words."""
    if reuse is None:
        return f"speculate: no earlier request of this tenant shares {MIN_SHARED} tokens or more of its start"
    added = n - reuse.length
    return {
        "extend": "extend: an earlier prompt again (or it and the start of its answer): that request's kept set",
        "whole": f"whole: adds {added} tokens (under min_new_tokens {max_new}) to {reuse.length} the base holds whole",
        "append": f"append: adds {added} tokens (min_new_tokens {max_new} or more) to an earlier pruned turn of "
        f"{reuse.length}: its kept set there, the addition selected afresh",
        "prefix": f"prefix: the base holds {reuse.length} leading tokens whole so far: those whole, the {added} after "
        "them selected afresh",
        "speculate": f"speculate: shares {reuse.length} tokens with an earlier request, under {MIN_SHARED} of them "
        "held whole: selected afresh",
    }[reuse.kind]


def predict_paths(reuse: Reuse | None, n: int, keep_rate: float, times: PairTimes) -> dict[str, float] | None:
    """Predicted seconds to the base's first token of each path a request on a prefix the base holds whole so far
    (`prefix`, an idle-time whole prefill part way) may take: selected afresh after the held part (`prefix`: the
    speculator computes what its cache lacks past the shared tokens, the base the kept tokens after the held part)
    or run whole (`whole`: the base computes the rest; the whole prompt's answer). None: another kind, or the rates
    not measured yet."""
    if reuse is None or reuse.kind != "prefix":
        return None
    rest = n - reuse.length
    spec = times.speculator.predict(n - reuse.shared)
    kept, whole = times.base.predict(round(keep_rate * rest)), times.base.predict(rest)
    if spec is None or kept is None or whole is None:
        return None
    return {"prefix": spec + kept, "whole": whole}


def cheapest(reuse: Reuse, n: int, paths: dict[str, float] | None) -> Reuse:
    """`reuse`, or the whole run where `paths` predicts it no slower (every path open to a `prefix` request is
    correct; the whole one also answers as the whole prompt does)."""
    if paths is None or paths["whole"] > paths["prefix"]:
        return reuse
    return Reuse("whole", reuse.length, np.arange(n, dtype=np.int64), shared=reuse.shared)


def decide(
    ids: Sequence[int],
    keep_rate: float,
    params: Any,
    min_prompt_tokens: int = 0,
    memory: TurnMemory | None = None,
    tenant: str = "",
    max_new: int = 0,
    times: PairTimes | None = None,
) -> Decision:
    """The request's path and why (the module's steps 1-4). `memory` None: nothing is remembered (no prefix
    caching); `times` None: no rates (the offline pair), paths are not weighed."""
    n = len(ids)
    whole = runs_whole(n, keep_rate, min_prompt_tokens, params)
    if whole is not None:
        return Decision(None, False, (whole,))
    reuse = plan_reuse(ids, memory, tenant, max_new) if memory is not None else None
    reasons = [explain(reuse, n, max_new) if memory is not None else "speculate: nothing remembered (no prefix cache)"]
    predicted = None if times is None else predict_paths(reuse, n, keep_rate, times)
    if reuse is not None and predicted is not None:
        chosen = cheapest(reuse, n, predicted)
        faster = "whole" if chosen is not reuse else "prefix"
        reasons.append(
            f"{faster}: predicted {predicted['prefix']:.2f} s selected after the held part, {predicted['whole']:.2f} s "
            f"with the rest whole (rates measured on this server)"
        )
        reuse = chosen
    elif reuse is not None and reuse.kind == "prefix" and times is not None:
        reasons.append("prefix: the rates are not measured yet (two request sizes per engine): not weighed")
    return Decision(reuse, reuse is None or reuse.speculates, tuple(reasons), predicted)
