"""Documents and questions from real files nobody on this project wrote: what installed packages ship (package
metadata, wheel RECORD files, entry points, SBOMs, lm-eval's task configs and READMEs, Python source, a CSV) and
Debian's MIME database. Each kind's parser (email headers, csv, configparser, json, yaml, markdown-it, ast, an XML
parser) reads the records and the answer to each question; the prompt is the real text, whole records of it.

A task is named `file:<kind>` (the question after the document), `file:<kind>/before` (before it), `file:<kind>@<mood>`
(the question in German, Spanish, Chinese or the imperative mood) or `file:chat_<shape>` (chat transcripts over the
SBOM components: the answer in an earlier assistant message, a correction after the question, two questions at
once). `TUNE_KINDS` and `REPORT_KINDS` split the file kinds in two halves: rules are designed on the first and
reported once on the second (`TUNE_CELLS`, `REPORT_CELLS`). Every record: {"task", "index", "input", "outputs",
"length", "metric": "all", "target_length", "records"}; deterministic per (task, length, seed, index) for one set
of installed packages (the project pins them)."""

from __future__ import annotations

import ast
import configparser
import csv
import email.parser
import functools
import importlib.metadata
import io
import json
import random
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specprefill.data.ruler import fit, seeded_records
from specprefill.errors import SpecPrefillError

PREFIX = "file:"
MIN_RECORDS = 3
MIME_DATABASE = Path("/usr/share/mime/packages/freedesktop.org.xml")  # Debian's shared-mime-info


@dataclass(frozen=True)
class Fact:
    """One record of a real file: its text in the document, the key a question names it by, the answer."""

    text: str
    key: str
    answer: str


@dataclass(frozen=True)
class Kind:
    """A file kind: where its records come from, how they are joined into one document, what is asked."""

    facts: Callable[[], list[Fact]]
    joiner: str
    ask: str  # English question; {key}
    head: str = ""  # text before the records (a CSV header, a JSON opening)
    foot: str = ""


def _dists() -> list[importlib.metadata.Distribution]:
    named = {d.metadata["Name"].lower(): d for d in importlib.metadata.distributions() if d.metadata["Name"]}
    return [named[k] for k in sorted(named)]


def _package_dir(name: str) -> Path:
    import importlib.util  # lazy: only where a kind reads a package's folder

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SpecPrefillError(
            f"the real-file corpus reads the installed package {name!r}: install the workbench extra"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _unique(facts: list[Fact]) -> list[Fact]:
    """Facts whose key names one record alone."""
    count: dict[str, int] = {}
    for f in facts:
        count[f.key] = count.get(f.key, 0) + 1
    return [f for f in facts if count[f.key] == 1]


@functools.cache
def metadata_facts() -> list[Fact]:
    """Each installed distribution's METADATA headers (email headers; classifiers and requirements left out)."""
    out = []
    for d in _dists():
        raw = d.read_text("METADATA") or ""
        head = raw.split("\n\n", 1)[0]
        msg = email.parser.HeaderParser().parsestr(head)
        lines = [ln for ln in head.splitlines() if not ln.startswith(("Classifier:", "Requires-Dist:", " "))]
        if msg["Name"] and msg["Version"]:
            out.append(Fact("\n".join(lines[:14]), msg["Name"], msg["Version"]))
    return _unique(out)


@functools.cache
def record_facts() -> list[Fact]:
    """Rows of the wheels' RECORD files (path, hash, size; csv): the size of one file."""
    out = []
    for d in _dists():
        rows = list(csv.reader(io.StringIO(d.read_text("RECORD") or "")))
        for row in rows[:40]:
            if len(row) == 3 and row[2].isdigit() and int(row[2]) >= 100 and not row[0].endswith((".pyc", "RECORD")):
                out.append(Fact(",".join(row), row[0], row[2]))
    return _unique(out)


@functools.cache
def entry_point_facts() -> list[Fact]:
    """The entry_points.txt files (INI, configparser): the object one named entry point refers to."""
    out = []
    for d in _dists():
        text = d.read_text("entry_points.txt")
        if not text:
            continue
        parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        try:
            parser.read_string(text)
        except configparser.Error:
            continue
        for section in parser.sections():
            items = [(k, v.strip()) for k, v in parser.items(section) if ":" in v or "." in v]
            if items:
                block = f"[{section}]\n" + "\n".join(f"{k} = {v}" for k, v in items[:8])
                out += [Fact(block, k, v) for k, v in items[:8]]
    # a question names an entry point whose name is unique; its section's block is its record
    return _unique(out)


@functools.cache
def sbom_facts() -> list[Fact]:
    """CycloneDX SBOMs that wheels ship (json): the version of one component (its type, name, version and package
    URL kept)."""
    out = []
    for d in _dists():
        for f in sorted(d.files or [], key=str):
            if "sboms/" in str(f) and str(f).endswith(".json"):
                data = json.loads(f.read_text())
                for c in data.get("components", []):
                    if c.get("name") and c.get("version"):  # its identifying fields (hashes, licenses left out)
                        kept = {k: c[k] for k in ("type", "name", "version", "purl") if k in c}
                        out.append(Fact(json.dumps(kept, indent=2), c["name"], c["version"]))
    return _unique(out)


@functools.cache
def task_config_facts() -> list[Fact]:
    """lm-eval's task configs (yaml): the dataset one task reads."""
    import yaml  # lazy: only this kind

    out = []
    for path in sorted((_package_dir("lm_eval") / "tasks").rglob("*.yaml")):
        text = path.read_text(errors="replace")
        if len(text) > 1200 or "!function" in text or "dataset_path:" not in text:
            continue
        try:
            conf = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml where built
        except yaml.YAMLError:
            continue
        if isinstance(conf, dict) and isinstance(conf.get("task"), str) and isinstance(conf.get("dataset_path"), str):
            out.append(Fact(text.strip(), conf["task"], conf["dataset_path"]))
    return _unique(out)


@functools.cache
def readme_facts() -> list[Fact]:
    """lm-eval's task READMEs (markdown, markdown-it): the homepage given in the section a title heading owns."""
    from markdown_it import MarkdownIt  # lazy: only this kind

    md = MarkdownIt("commonmark")
    out = []
    for path in sorted((_package_dir("lm_eval") / "tasks").glob("*/README.md")):
        text = path.read_text(errors="replace")
        tokens = md.parse(text)
        title = next(
            (t for i, t in enumerate(tokens) if t.type == "inline" and tokens[i - 1].type == "heading_open"), None
        )
        home = re.search(r"^\s*\**Homepage\**:?\**\s*<?(https?://[^\s>)]+)", text, re.MULTILINE | re.IGNORECASE)
        if title is None or home is None or len(text) > 6000:
            continue
        cut = text[: text.find("\n#", home.end()) if text.find("\n#", home.end()) > 0 else len(text)]
        if len(cut) <= 1600:  # the title's section through the homepage's
            out.append(Fact(cut.strip(), title.content.strip(), home[1].rstrip(".,")))
    return _unique(out)


def _segment(lines: list[str], node: ast.AST) -> str:
    """A node's source text (`ast.get_source_segment` without splitting the file again per node; columns are UTF-8
    byte offsets)."""
    first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[attr-defined]
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()  # type: ignore[attr-defined]
    head = lines[first].encode()[node.col_offset :].decode()  # type: ignore[attr-defined]
    tail = lines[last].encode()[: node.end_col_offset].decode()  # type: ignore[attr-defined]
    return head + "".join(lines[first + 1 : last]) + tail


@functools.cache
def code_facts() -> list[Fact]:
    """Functions and classes of torch's nn.modules, optim and utils.data packages (Python, ast): the default of a
    parameter whose default is a number or a string other than 0, 1 or "" (a function's own, a class's `__init__`'s).
    The key is "`P` of `F`"."""
    out = []
    root = _package_dir("torch")
    for path in sorted(
        [*(root / "nn").rglob("*.py"), *(root / "optim").rglob("*.py"), *(root / "utils" / "data").rglob("*.py")]
    ):
        source = path.read_text(errors="replace")
        try:
            body = ast.parse(source).body
        except SyntaxError:
            continue
        lines = source.splitlines(keepends=True)
        for node in body:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                continue
            if isinstance(node, ast.ClassDef):
                func = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
            else:
                func = node if isinstance(node, ast.FunctionDef) else None
            seg = _segment(lines, node)
            if func is None or not 150 < len(seg) < 1200:
                continue
            args = func.args.args[len(func.args.args) - len(func.args.defaults) :]
            for arg, default in zip(args, func.args.defaults):
                value = default.value if isinstance(default, ast.Constant) else None
                if isinstance(value, (int, float, str)) and not isinstance(value, bool) and value not in (0, 1, ""):
                    shown = value if isinstance(value, str) else _segment(lines, default)
                    out.append(Fact(seg, f"`{arg.arg}` of `{node.name}`", str(shown)))
    return _unique(out)


@functools.cache
def mime_facts() -> list[Fact]:
    """Debian's MIME database (XML, ElementTree): the first file name pattern of one MIME type (its translated
    comments left out)."""
    if not MIME_DATABASE.exists():
        raise SpecPrefillError(f"the xml_mime kind reads {MIME_DATABASE}: apt-get install shared-mime-info")
    ns = "{http://www.freedesktop.org/standards/shared-mime-info}"
    out = []
    for el in ET.parse(MIME_DATABASE).getroot():
        for c in list(el):
            if c.tag == f"{ns}comment" and c.attrib:
                el.remove(c)
        globs = [g.get("pattern") for g in el.findall(f"{ns}glob")]
        if globs and globs[0] and len(el) <= 12:
            text = ET.tostring(el, encoding="unicode").replace(f' xmlns:ns0="{ns[1:-1]}"', "").replace("ns0:", "")
            out.append(Fact(text.strip(), el.get("type", ""), globs[0]))
    return _unique(out)


@functools.cache
def stocks_facts() -> list[Fact]:
    """matplotlib's Stocks.csv sample (csv): the AAPL close on one date."""
    path = _package_dir("matplotlib") / "mpl-data" / "sample_data" / "Stocks.csv"
    rows = list(csv.reader(path.read_text().splitlines()[1:]))
    header, body = rows[0], rows[1:]
    col = header.index("AAPL")
    return [Fact(",".join(r), r[0], r[col]) for r in body if len(r) == len(header) and r[col]]


KINDS: dict[str, Kind] = {
    "metadata": Kind(metadata_facts, "\n\n", "What is the version of the package {key}? Answer with the version only."),
    "task_yaml": Kind(
        task_config_facts, "\n---\n", "Which dataset path does the task {key} use? Answer with the path only."
    ),
    "stocks_csv": Kind(
        stocks_facts,
        "\n",
        "What was the AAPL value on {key}? Answer with the number only.",
        head="Date,IBM,AAPL,MSFT,XRX,AMZN,DELL,GOOGL,ADBE,^GSPC,^IXIC\n",
    ),
    "sbom_json": Kind(
        sbom_facts,
        ",\n",
        "What is the version of the component {key}? Answer with the version only.",
        '{"components": [\n',
        "\n]}",
    ),
    "record_csv": Kind(record_facts, "\n", "What is the size in bytes of the file {key}? Answer with the number only."),
    "entry_points_ini": Kind(
        entry_point_facts, "\n\n", "Which object does the entry point {key} refer to? Answer with the object only."
    ),
    "readme_md": Kind(readme_facts, "\n\n", "What is the homepage of {key}? Answer with the URL only."),
    "code_py": Kind(
        code_facts, "\n\n\n", "What is the default value of the parameter {key}? Answer with the value only."
    ),
    "xml_mime": Kind(
        mime_facts,
        "\n",
        "Which file name pattern does the MIME type {key} use? Answer with the pattern only.",
        "<mime-info>\n",
        "\n</mime-info>",
    ),
}
TUNE_KINDS = ("metadata", "task_yaml", "stocks_csv")
REPORT_KINDS = ("sbom_json", "record_csv", "entry_points_ini", "readme_md", "code_py", "xml_mime")
MOODS = {
    "de": "Welche Version hat die Komponente {key}? Antworte nur mit der Version.",
    "es": "¿Qué versión tiene el componente {key}? Responde solo con la versión.",
    "zh": "组件 {key} 的版本号是多少？只回答版本号。",
    "imperative": "Give me the version of the component {key}, nothing else.",
}
CHATS = ("chat_earlier", "chat_correction", "chat_several")
TUNE_CELLS = [f"{PREFIX}{k}" for k in TUNE_KINDS] + [f"{PREFIX}{k}/before" for k in TUNE_KINDS]
REPORT_FORMATS = [f"{PREFIX}{k}" for k in REPORT_KINDS]
REPORT_TURNS = (
    [f"{PREFIX}sbom_json@{m}" for m in MOODS] + [f"{PREFIX}record_csv/before"] + [f"{PREFIX}{c}" for c in CHATS]
)
REPORT_CELLS = REPORT_FORMATS + REPORT_TURNS


def parse(task: str) -> tuple[str, str, str]:
    """(kind, position "after"/"before", mood "" or a `MOODS` key) of a task name, or a chat shape."""
    if not task.startswith(PREFIX):
        raise SpecPrefillError(f"{task!r} is no real-file task: name one file:<kind>[/before][@mood]")
    body = task[len(PREFIX) :]
    body, _, mood = body.partition("@")
    kind, _, position = body.partition("/")
    if kind in CHATS and not position and not mood:
        return kind, "after", ""
    if kind not in KINDS or position not in ("", "before") or (mood and mood not in MOODS):
        raise SpecPrefillError(
            f"{task!r}: use file:<kind>[/before][@mood] with a kind of {', '.join(KINDS)} and a mood of "
            f"{', '.join(MOODS)}, or file:<{'|'.join(CHATS)}>"
        )
    return kind, position or "after", mood


def _document(kind: Kind, picked: list[Fact]) -> str:
    """The records' texts joined as the file kind joins them (a block that holds several facts once)."""
    return kind.head + kind.joiner.join(dict.fromkeys(f.text for f in picked)) + kind.foot


def _question(kind: str, mood: str, fact: Fact) -> str:
    return (MOODS[mood] if mood else KINDS[kind].ask).format(key=fact.key)


def _render(tokenizer, messages: list[dict]) -> str:
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def _chat(shape: str, picked: list[Fact], asked: Fact, other: Fact) -> list[dict]:
    kind = KINDS["sbom_json"]
    doc = _document(kind, picked)
    if shape == "chat_earlier":  # the document is the assistant's earlier answer
        listing = "\n".join(f"- {f.key}: {f.answer}" for f in picked)
        return [
            {"role": "user", "content": "Which versions do the components of this SBOM have?"},
            {"role": "assistant", "content": f"Here are the versions:\n{listing}"},
            {"role": "user", "content": f"Thanks. And which version did you give for {asked.key}? Just the version."},
        ]
    if shape == "chat_correction":
        ask = f"What is the version of the component {other.key}? Sorry, I meant {asked.key}. Just the version."
    else:
        ask = f"What are the versions of the components {asked.key} and {other.key}? Just the two versions."
    return [{"role": "user", "content": f"Here is an SBOM:\n\n{doc}\n\n{ask}"}]


def _pair(picked: list[Fact], pick: float, second: float) -> tuple[Fact, Fact]:
    """The asked record and another one (a correction's first name, a second question)."""
    asked = picked[int(pick * len(picked))]
    rest = [f for f in picked if f is not asked] or [asked]
    return asked, rest[int(second * len(rest))]


def _one(task: str, tokenizer, length: int, rng: random.Random) -> dict:
    kind_name, position, mood = parse(task)
    chat = kind_name in CHATS
    kind = KINDS["sbom_json" if chat else kind_name]
    facts = list(kind.facts())
    if len(facts) < MIN_RECORDS:
        raise SpecPrefillError(f"{task!r}: the installed files give {len(facts)} records, fewer than {MIN_RECORDS}")
    rng.shuffle(facts)
    pick, second = rng.random(), rng.random()
    built: dict[str, int] = {}

    def build(count: int) -> str:
        picked = facts[:count]
        asked, other = _pair(picked, pick, second)
        if chat:
            text = _render(tokenizer, _chat(kind_name, picked, asked, other))
        else:
            doc = _document(kind, picked)
            q = _question(kind_name, mood, asked)
            user = f"{q}\n\n{doc}" if position == "before" else f"{doc}\n\n{q}"
            text = _render(tokenizer, [{"role": "user", "content": user}])
        built[text] = count
        return text

    text, tokens = fit(tokenizer, build, length, min(len(facts), 400))
    count = built[text]
    if count < MIN_RECORDS:
        raise SpecPrefillError(f"{length} tokens hold {count} records of {task}, fewer than {MIN_RECORDS}: raise it")
    picked = facts[:count]
    asked, other = _pair(picked, pick, second)
    answers = [asked.answer, other.answer] if kind_name == "chat_several" else [asked.answer]
    return {"input": text, "outputs": answers, "length": tokens, "metric": "all", "records": count}


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """n prompts of `task` within `length` tokens (as the tokenizer counts them), rendered with its chat template."""
    parse(task)
    return seeded_records(task, tokenizer, length, n, seed, _one)
