"""Records of real files nobody on this project wrote, each read by its format's parser: installed packages'
metadata (email headers), wheel RECORD files (csv), entry points (configparser), CycloneDX SBOMs (json), lm-eval's
task configs (yaml) and READMEs (markdown-it), torch's source (ast), matplotlib's Stocks.csv sample (csv) and
Debian's MIME database (an XML parser). Each `Fact` is one record's text, the key a question names it by and the
answer its parser finds; `data.realfiles` builds the prompts."""

from __future__ import annotations

import ast
import configparser
import csv
import email.parser
import functools
import importlib.metadata
import io
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from specprefill.errors import SpecPrefillError

MIME_DATABASE = Path("/usr/share/mime/packages/freedesktop.org.xml")  # Debian's shared-mime-info


@dataclass(frozen=True)
class Fact:
    """One record of a real file: its text in the document, the key a question names it by, the answer."""

    text: str
    key: str
    answer: str


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
