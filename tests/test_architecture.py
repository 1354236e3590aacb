"""The house rules of the code, checked on its import graph (static: every
import statement, module level or inside a function, counts):

- no import circle anywhere in the project;
- dependencies point one way: gateway -> budgets -> tenants; inference_sim
  (it stands in for a GPU server) and llm_tokens (a library both sides count
  tokens with) import none of the Django apps; no app imports llm_platform
  (the project wires the apps, not the other way round);
- gateway's two sides share gateway.core and never import each other: the
  web side enqueues by task name;
- no app imports inference_sim (the request path never loads the test
  simulator), and adapters/ imports no app.

docs/architecture.md draws the same picture."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tenants", "budgets", "gateway", "llm_platform", "inference_sim", "llm_tokens", "adapters")
DJANGO_APPS = ("tenants", "budgets", "gateway")

# (importer prefix, imported prefix): never allowed.
FORBIDDEN = [
    ("tenants", "budgets"), ("tenants", "gateway"),
    ("budgets", "gateway"),
    *[(app, "llm_platform") for app in (*DJANGO_APPS, "inference_sim", "llm_tokens")],
    *[(lib, app) for lib in ("inference_sim", "llm_tokens") for app in DJANGO_APPS],
    # The request path never loads the test simulator: it stands in for a GPU server.
    *[(app, "inference_sim") for app in DJANGO_APPS],
    # The adapters wrap libraries; the apps use them, never the other way round.
    *[("adapters", app) for app in (*DJANGO_APPS, "llm_platform", "inference_sim", "llm_tokens")],
    ("llm_tokens", "inference_sim"),
    ("gateway.core", "gateway.web"), ("gateway.core", "gateway.worker"),
    ("gateway.web", "gateway.worker"), ("gateway.worker", "gateway.web"),
    ("gateway.models", "gateway.web"), ("gateway.models", "gateway.worker"),
]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (a ``from a import b`` where
    a.b is a module counts as importing a.b)."""
    files = {module_name(root, p): p for pkg in packages for p in (root / pkg).rglob("*.py")
             if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{importer} imports {imported}"
                  for importer, imported_set in graph.items() for imported in imported_set
                  for low, high in FORBIDDEN if _within(importer, low) and _within(imported, high))


def test_no_import_circle_anywhere():
    assert import_cycles(import_graph(ROOT)) == []


def test_dependencies_point_one_way():
    assert forbidden_imports(import_graph(ROOT)) == []


def test_the_web_side_enqueues_by_name_without_importing_the_worker():
    graph = import_graph(ROOT)
    web = {m for m in graph if _within(m, "gateway.web")}
    assert web and {"gateway.web.views", "gateway.web.dispatch"} <= web
    reachable, todo = set(), list(web)
    while todo:  # everything the web side loads, transitively
        for succ in graph.get(todo.pop(), ()):
            if succ not in reachable:
                reachable.add(succ)
                todo.append(succ)
    assert not {m for m in reachable if _within(m, "gateway.worker")}


@pytest.mark.parametrize("source_a, source_b, expected", [
    ("from pkg import b\n", "from pkg.a import x\n", [["pkg.a", "pkg.b"]]),
    ("def f():\n    from . import b\n", "from .a import x\n", [["pkg.a", "pkg.b"]]),  # a local import still counts
    ("from pkg import b\n", "x = 1\n", []),
])
def test_the_checker_finds_a_circle(tmp_path, source_a, source_b, expected):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(source_a)
    (package / "b.py").write_text(source_b)
    assert import_cycles(import_graph(tmp_path, packages=("pkg",))) == expected


def test_the_checker_finds_an_app_importing_the_simulator(tmp_path):
    for package, source in (("gateway", "from inference_sim.protocol import SIM_FIELDS\n"), ("inference_sim", "")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(source)
    (tmp_path / "inference_sim" / "protocol.py").write_text("SIM_FIELDS = ()\n")
    graph = import_graph(tmp_path, packages=("gateway", "inference_sim"))
    assert forbidden_imports(graph) == ["gateway imports inference_sim.protocol"]


def test_the_checker_finds_a_forbidden_import(tmp_path):
    for package, source in (("budgets", "from gateway.core import keys\n"), ("gateway", "")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(source)
    (tmp_path / "gateway" / "core").mkdir()
    (tmp_path / "gateway" / "core" / "__init__.py").write_text("")
    (tmp_path / "gateway" / "core" / "keys.py").write_text("")
    graph = import_graph(tmp_path, packages=("budgets", "gateway"))
    assert forbidden_imports(graph) == ["budgets imports gateway.core.keys"]


def test_comments_cite_documents_that_are_in_the_repository():
    """A comment pointing at a design note the reader cannot open is a dead
    end: every ``*.md`` (or ``path/*.py``/``*.lua``) a source file names exists."""
    cited = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:md|lua)|(?:[\w-]+/)+[\w-]+\.py)\b")
    missing = []
    for package in (*PACKAGES, "bench"):
        for path in (ROOT / package).rglob("*"):
            if path.suffix not in {".py", ".lua", ".html"} or "__pycache__" in path.parts:
                continue
            for name in cited.findall(path.read_text()):
                top = name.split("/")[0]
                if "/" in name and top not in PACKAGES and importlib.util.find_spec(top) is not None:
                    continue  # a file of an installed library (tiktoken_ext/openai_public.py)
                if not (ROOT / name).exists() and not (path.parent / name).exists():
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []


# A measurement in product code goes stale with the next run: figures and the
# rounds of bench/PROFILE.md live there, once. The adapters state their gain
# by design (adapters/__init__.py).
MEASUREMENT = re.compile(r"\b\d+(?:\.\d+)?\s?(?:µs|us)\b|PROFILE\.md,? rounds? \d|round \d+\)")


def measurements_in_code(root: Path, packages) -> list[str]:
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in {".py", ".lua"} and "__pycache__" not in path.parts:
                for number, line in enumerate(path.read_text().splitlines(), start=1):
                    if MEASUREMENT.search(line):
                        found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_product_code_carries_no_measurements():
    assert measurements_in_code(ROOT, [p for p in PACKAGES if p != "adapters"]) == []


def test_the_checker_finds_a_measurement(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("# costs 30 µs a call\nx = 1\n# see bench/PROFILE.md, round 7\n")
    (tmp_path / "pkg" / "b.lua").write_text("-- units: ms, us\nlocal x = 1\n")
    assert measurements_in_code(tmp_path, ["pkg"]) == ["pkg/a.py:1", "pkg/a.py:3"]
