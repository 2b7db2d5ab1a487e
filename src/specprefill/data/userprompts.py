"""A user's own prompts as task groups (`specprefill leaderboard run --prompts FILE.jsonl`): one JSON object per line,

    {"prompt": "...", "answers": ["..."], "metric": "part", "group": "contracts"}
    {"messages": [{"role": "user", "content": "..."}], "answers": ["42"]}

`prompt` (a completion prompt, sent as it is) or `messages` (a chat, rendered with the base's chat template),
`answers` (the reference answers, strings), `metric` (one of `data.metrics.METRICS`, default "part": the answer
appears in the output) and `group` (default "prompts": the board's task group, judged like the built-in groups).
The whole file is read and checked before anything runs: a bad line is refused with its line number and field.

Each group becomes one task, `prompts:<digest>/<group>/<path>`: the file's content digest in the name, so a board,
its units and a resumed run are keyed by what the file held, and a file changed since is refused, not mixed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from urllib.parse import quote, unquote

from specprefill.data.metrics import METRICS
from specprefill.errors import SpecPrefillError

PREFIX = "prompts:"
DEFAULT_GROUP = "prompts"
DEFAULT_METRIC = "part"
FIELDS = ("prompt", "messages", "answers", "metric", "group")
MIN_LENGTH = 128  # a group's length as the board checks it (`board.check_groups`)


def read(path: str | Path) -> list[dict]:
    """Every line of the file checked: [{"prompt" or "messages", "answers", "metric", "group", "line"}]."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecPrefillError(f"--prompts {path}: cannot read it ({exc}): give a UTF-8 JSON-lines file") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            out.append({**_checked(json_line(line, number, path), number, path), "line": number})
    if not out:
        raise SpecPrefillError(f"--prompts {path}: no prompts in it: one JSON object per line")
    return out


def json_line(line: str, number: int, path) -> dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecPrefillError(f"--prompts {path}, line {number}: not JSON ({exc.msg}): one object per line") from None
    if not isinstance(value, dict):
        raise SpecPrefillError(
            f"--prompts {path}, line {number}: a JSON object is expected, not {type(value).__name__}"
        )
    return value


def _checked(row: dict, number: int, path) -> dict:
    where = f"--prompts {path}, line {number}"
    unknown = sorted(set(row) - set(FIELDS))
    if unknown:
        raise SpecPrefillError(f"{where}: unknown field {unknown[0]!r}: the fields are {', '.join(FIELDS)}")
    if ("prompt" in row) == ("messages" in row):
        raise SpecPrefillError(f'{where}: give either "prompt" (a string) or "messages" (a chat), not both/none')
    if "prompt" in row and (not isinstance(row["prompt"], str) or not row["prompt"].strip()):
        raise SpecPrefillError(f'{where}: "prompt" must be a non-empty string')
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(_message(m) for m in messages):
            raise SpecPrefillError(
                f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": "..."}} objects'
            )
    answers = row.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise SpecPrefillError(f'{where}: "answers" must be a non-empty list of non-empty strings')
    metric = row.get("metric", DEFAULT_METRIC)
    if metric not in METRICS:
        raise SpecPrefillError(f'{where}: "metric" {metric!r} is unknown: use one of {", ".join(METRICS)}')
    group = row.get("group", DEFAULT_GROUP)
    if not isinstance(group, str) or not group.strip() or "/" in group:
        raise SpecPrefillError(f"{where}: \"group\" must be a non-empty name without '/'")
    return {**row, "metric": metric, "group": group.strip()}


def _message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def task_name(path: str | Path, group: str, file_digest: str) -> str:
    return f"{PREFIX}{file_digest}/{quote(group, safe='')}/{Path(path).resolve()}"


def parse(task: str) -> tuple[str, str, str]:
    """(digest, group, path) of a task name `prompts:<digest>/<group>/<path>`."""
    if not task.startswith(PREFIX) or task.count("/") < 2:
        raise SpecPrefillError(f"{task!r}: a user-prompt task is named prompts:<digest>/<group>/<path>")
    file_digest, group, path = task[len(PREFIX) :].split("/", 2)
    return file_digest, unquote(group), path


def rendered(tokenizer, row: dict) -> str:
    """The text the base reads: the prompt as given, or the chat rendered with the tokenizer's template."""
    if "prompt" in row:
        return str(row["prompt"])
    text: str = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    return text


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """The first `n` prompts of the task's group, as the experiments read records ("task", "index", "input",
    "outputs", "metric", "length" in the tokenizer's tokens, the file's "line"). A file changed since the task was
    named is refused."""
    file_digest, group, path = parse(task)
    if not Path(path).is_file():
        raise SpecPrefillError(f"{task}: the prompts file {path} is gone: run leaderboard run --prompts FILE again")
    if digest(path) != file_digest:
        raise SpecPrefillError(f"{path} changed since this run was set up: run leaderboard run --prompts again")
    out = []
    for i, row in enumerate([r for r in read(path) if r["group"] == group][:n]):
        text = rendered(tokenizer, row)
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(
            {"task": task, "index": i, "input": text, "outputs": list(row["answers"]), "metric": row["metric"],
             "length": tokens, "line": row["line"]}
        )  # fmt: skip
    return out


def board_groups(path: str | Path, tokenizer) -> dict[str, dict]:
    """The board's task groups of the file, in the order they first appear: {group: {tasks, length, n}}, the length
    the longest prompt's tokens (at least `MIN_LENGTH`)."""
    rows = read(path)
    file_digest = digest(path)
    groups: dict[str, dict] = {}
    for row in rows:
        tokens = len(tokenizer(rendered(tokenizer, row), add_special_tokens=False)["input_ids"])
        g = groups.setdefault(
            row["group"], {"tasks": [task_name(path, row["group"], file_digest)], "length": 0, "n": 0}
        )
        g["length"], g["n"] = max(g["length"], tokens, MIN_LENGTH), g["n"] + 1
    return groups
