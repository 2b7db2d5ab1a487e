"""The package's shape: no import cycles between its modules, no hidden package imports, one source of defaults."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specprefill"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(tree: ast.AST, here: str):
    """(node, imported module) for every import of this package, module-level or not."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "specprefill":
                    yield node, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specprefill":
            for alias in node.names:  # `from specprefill.x import y` may import the submodule y
                yield node, f"{node.module}.{alias.name}"


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module-level imports only (what runs when a module is imported), by module."""
    graph = {}
    for name, source in modules.items():
        tree = ast.parse(source)
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        deps = set()
        for node in top:
            for _, target in package_imports(ast.Module(body=[node], type_ignores=[]), name):
                dep = resolve(target)
                if dep and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph({name: path.read_text() for name, path in MODULES.items()})
    assert "specprefill.core" in graph["specprefill.engines.hf"]  # the graph is real
    assert cycles(graph) == []


def all_imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """Every import of this package, lazy ones inside functions included, by module."""
    graph = {}
    for name, source in modules.items():
        deps = {resolve(target) for _, target in package_imports(ast.parse(source), name)}
        graph[name] = {d for d in deps if d and d != name}
    return graph


def test_no_import_cycles_lazy_imports_included():
    """A lazy import only hides a cycle from import time: two modules that need each other are one module or a
    third below both."""
    assert cycles(all_imports({"a": "import specprefill.b", "b": "def f():\n    import specprefill.a"})) == []
    graph = all_imports({name: path.read_text() for name, path in MODULES.items()})
    assert "specprefill.engines.vllm.adapter" in graph["specprefill.cli.run"]  # lazy ones counted
    assert cycles(graph) == []


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def long_functions(source: str) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines without a comment on their `def` line saying why."""
    lines = source.splitlines()
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        and "#" not in lines[node.lineno - 1]
    ]


def test_files_and_functions_stay_short():
    """The size rule: a module over 400 lines is split by job; a function over 60 lines is split, or says why on
    its `def` line."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(f"def f():  # one table of cases\n{body}\n") == []
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"split these modules by job: {long}"
    found = {name: f for name, path in MODULES.items() if (f := long_functions(path.read_text()))}
    assert found == {}, f"split these functions, or say why on the def line: {found}"


def hidden_imports(source: str) -> list[int]:
    """Line numbers of package imports inside a function or class without a comment saying why."""
    lines = source.splitlines()
    bad = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and any(package_imports(inner, "")):
                    text = "\n".join(lines[inner.lineno - 1 : inner.end_lineno])
                    if "#" not in text:
                        bad.append(inner.lineno)
    return sorted(set(bad))


def test_hidden_import_finder():
    src = "def f():\n    from specprefill import core\n\ndef g():\n    from specprefill import models  # lazy: why\n"
    assert hidden_imports(src) == [2]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_package_imports_are_at_the_top_or_say_why(name):
    assert hidden_imports(MODULES[name].read_text()) == [], f"{name}: move these imports to the top, or comment why not"


def test_help_loads_neither_torch_nor_vllm():
    code = (
        "import sys\nfrom specprefill import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# lm-eval's model class of this package derives from lm-eval's vLLM model: importing it is running an engine
IMPORTS_VLLM = {"specprefill.lm_eval"}


def test_only_what_runs_an_engine_imports_vllm():
    """A notebook, the report, the explorer or a test collection that imports the workbench does not pay vLLM's
    import (~8 s here): vLLM is imported where an engine starts. Nor do `--prepare-only`, a notebook's parameter
    check or the memory plan: they read vLLM's platform rule and engine argument names without importing it."""
    names = sorted(n for n in MODULES if n not in IMPORTS_VLLM and not n.endswith("__main__"))
    params = "EngineParams(speculator='smollm2-135m', base='smollm2-135m', engine_args={'seed': 1})"
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'vllm' in sys.modules:\n"
        "        print(name)\n"
        "        break\n"
        "from specprefill.config import EngineParams\n"
        "from specprefill.engines.vllm import checks, sizing\n"
        f"checks.validate({params})\n"
        "if sizing.is_cpu() is not None and 'vllm' in sys.modules:\n"
        "    print('checks.validate or sizing.is_cpu')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"{out.strip()} imports vLLM at import time: import it where the engine starts"


# The house: each room (a top-level module or package of specprefill) on a floor; a module-level import goes to a room
# on the same floor or below, never up (a lazy import inside a function says why, `hidden_imports`). The drawing in
# docs/guide.md (Layout) is this table.
FLOORS = {
    0: ("errors", "atomic", "cache", "project", "quiet", "vllm_dist", "wheels"),
    1: ("config", "flags", "settings"),
    2: ("hardware", "core"),
    3: ("models", "roles", "structure", "tokenmap", "llmlingua", "compress", "retrieval"),
    4: ("engines", "data", "selectors"),
    5: ("calibrate", "lm_eval", "serve", "refcheck"),
    6: ("workbench", "viz"),
    7: ("cli", "__main__", "specprefill"),
}
FLOOR = {room: floor for floor, rooms in FLOORS.items() for room in rooms}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    up = [(a, b) for a, deps in graph.items() for b in deps if FLOOR[room(b)] > FLOOR[room(a)]]
    return sorted(f"{a} -> {b}" for a, b in up)


def test_every_room_has_a_floor_and_no_import_goes_up():
    graph = import_graph({name: path.read_text() for name, path in MODULES.items()})
    assert {room(n) for n in graph} == set(FLOOR), "put a new top-level module on a floor of FLOORS"
    assert upward_imports({"specprefill.core.x": {"specprefill.workbench.y"}}) == [
        "specprefill.core.x -> specprefill.workbench.y"
    ]  # the finder finds a planted one
    assert upward_imports(graph) == []
