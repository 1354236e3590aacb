"""A library's private names are used only in ``adapters/`` (shared/DESIGN.md,
"Dependencies and library internals"): a library's next release may rename
or drop them, and one package, each module of which names the versions it
was written against and the test that guards it, is where a newcomer looks
when an upgrade breaks something.

The checker reads every module outside ``adapters/`` and its guarding tests
(``tests/adapters/``): product code, bench and the other tests (static, by
its syntax tree), and finds:

- ``from lib import _name``, ``import lib._module``, ``from lib._module import x``;
- ``anything._name`` where no Sluice code outside ``adapters/`` defines
  ``_name`` (a function, class, module global, class attribute or
  ``self._name = ...``): an attribute of somebody else's object;
- a class whose bases include a library's class and that defines (or sets on
  ``self``) a private name that library class already has: an override of
  the library's internals.

Single-underscore names the library documents as public are allowed below,
each with its reason. The checker proves itself on planted samples."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("llm_platform", "tenants", "budgets", "gateway", "inference_sim", "llm_tokens", "adapters", "bench")
ADAPTERS = "adapters"
# The tests too: only an adapter's own guarding tests (tests/adapters/) reach
# into the library it adapts, to fail when an upgrade moves what it relies on.
CHECKED = (*PRODUCT, "tests")
ALLOWED = (ADAPTERS, "tests.adapters")

# Underscored names their libraries document as public API.
DOCUMENTED_PUBLIC = {
    "_meta": "Django's Model._meta API (docs: 'Model _meta API')",
    "_exit": "os._exit, the standard library's documented immediate exit",
    "_asdict": "namedtuple's documented methods",
    "_replace": "namedtuple's documented methods",
    "_fields": "namedtuple's documented attributes",
    "_make": "namedtuple's documented methods",
    "_state": "Django documents Model._state (adding, db) in its model instance reference",
    "_request": "DRF documents Request._request, the underlying HttpRequest",
    "_name_": "enum's documented members",
    "_value_": "enum's documented members",
    "_missing_": "enum's documented hook",
    "_generate_next_value_": "enum's documented hook",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(root: Path, packages) -> dict[str, tuple[Path, ast.Module]]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts and "migrations" not in path.parts:
                found[_module_name(root, path)] = (path, ast.parse(path.read_text(), filename=str(path)))
    return found


def _in_adapters(module: str, adapters: tuple[str, ...]) -> bool:
    return any(module == allowed or module.startswith(allowed + ".") for allowed in adapters)


def _self_assigned(node: ast.AST) -> set[str]:
    """Names a function body sets on ``self`` (or ``cls``)."""
    names = set()
    for sub in ast.walk(node):
        targets = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for leaf in ast.walk(target):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id in ("self", "cls")):
                    names.add(leaf.attr)
    return names


def defined_names(sources) -> set[str]:
    """Every private name the given modules define themselves."""
    names: set[str] = set()
    for _path, tree in sources.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                names |= _self_assigned(node)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # __slots__ entries, getattr by name of our own attributes
    return {name for name in names if _private(name)}


def _top(module: str) -> str:
    return module.split(".")[0]


def private_imports(module: str, tree: ast.Module, ours: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _top(alias.name) not in ours and any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{module}:{node.lineno} imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _top(node.module) not in ours:
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
            if any(_private(part) for part in names):
                found.append(f"{module}:{node.lineno} imports from {node.module}: "
                             + ", ".join(alias.name for alias in node.names))
    return found


def foreign_attributes(module: str, tree: ast.Module, defined: set[str]) -> list[str]:
    return [f"{module}:{node.lineno} uses .{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _private(node.attr)
            and node.attr not in defined and node.attr not in DOCUMENTED_PUBLIC]


def private_overrides(module: str, tree: ast.Module, ours: set[str]) -> list[str]:
    """A class of ``module`` that defines a private name one of its
    library bases has (imports the module to read the real bases)."""
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    if not classes:
        return []
    loaded = importlib.import_module(module)
    found = []
    for node in classes:
        cls = getattr(loaded, node.name, None)
        if not inspect.isclass(cls):
            continue
        theirs = [base for base in cls.__mro__[1:] if _top(base.__module__) not in ours and base is not object]
        if not theirs:
            continue
        # What the class body writes itself (not what a metaclass adds to it).
        mine = set()
        for member in node.body:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mine |= {member.name} | _self_assigned(member)
            elif isinstance(member, (ast.Assign, ast.AnnAssign)):
                targets = member.targets if isinstance(member, ast.Assign) else [member.target]
                mine |= {leaf.id for target in targets for leaf in ast.walk(target) if isinstance(leaf, ast.Name)}
        mine = {name for name in mine if _private(name)}
        for name in sorted(mine):
            owner = next((base for base in theirs if name in vars(base) or name in getattr(base, "__slots__", ())),
                         None)
            if owner is not None and name not in DOCUMENTED_PUBLIC:
                found.append(f"{module}.{node.name} overrides {owner.__module__}.{owner.__qualname__}.{name}")
    return found


def library_internals_outside_adapters(root: Path = ROOT, packages=CHECKED, adapters: tuple[str, ...] = ALLOWED,
                                       ours: set[str] | None = None) -> list[str]:
    ours = ours if ours is not None else set(packages)
    sources = _sources(root, packages)
    outside = {module: found for module, found in sources.items() if not _in_adapters(module, adapters)}
    defined = defined_names(outside)
    problems = []
    for module, (_path, tree) in outside.items():
        problems += private_imports(module, tree, ours)
        problems += foreign_attributes(module, tree, defined)
        problems += private_overrides(module, tree, ours)
    return sorted(problems)


def test_no_library_internals_outside_the_adapters():
    assert library_internals_outside_adapters() == []


def test_every_adapter_states_its_versions_gain_and_guarding_test():
    """Each adapter module's docstring says what DESIGN.md asks of it."""
    missing = []
    for path in sorted((ROOT / ADAPTERS).glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").lower()
        for needed in ("written against", "replaces", "gain", "tests/"):
            if needed not in doc:
                missing.append(f"{path.name}: no '{needed}'")
        guard = next((word for word in doc.replace("`", " ").split() if word.startswith("tests/")), "")
        guard_file = guard.split("::")[0].rstrip(".,;:)")
        if guard_file and not (ROOT / guard_file).exists():
            missing.append(f"{path.name}: its test {guard_file} does not exist")
    assert missing == []


# The checker, on planted samples.

@pytest.fixture
def planted(tmp_path, monkeypatch):
    def plant(files: dict[str, str]) -> list[str]:
        for name, source in files.items():
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        for module in [m for m in sys.modules if m.split(".")[0] in ("app", "glue")]:
            del sys.modules[module]
        return library_internals_outside_adapters(tmp_path, packages=("app", "glue"), adapters=("glue",))
    return plant


def test_the_checker_finds_a_library_private_attribute(planted):
    found = planted({
        "app/__init__.py": "",
        "app/a.py": "import http.client\n\ndef f(fp):\n    return http.client._read_headers(fp)\n",
        "glue/__init__.py": "",
        "glue/h.py": "import http.client\n\ndef g(fp):\n    return http.client._read_status(fp)\n",
    })
    assert found == ["app.a:4 uses ._read_headers"]


def test_the_checker_lets_our_own_private_names_be(planted):
    found = planted({
        "app/__init__.py": "",
        "app/a.py": ("class Box:\n    def __init__(self):\n        self._items = []\n\n"
                     "def count(box):\n    return len(box._items)\n"),
        "glue/__init__.py": "",
    })
    assert found == []


def test_the_checker_finds_a_private_import(planted):
    found = planted({
        "app/__init__.py": "",
        "app/a.py": "from json import _default_decoder\nimport email._policybase\n",
        "glue/__init__.py": "",
    })
    assert found == ["app.a:1 imports from json: _default_decoder", "app.a:2 imports email._policybase"]


def test_the_checker_finds_an_override_of_a_library_private_method(planted):
    found = planted({
        "app/__init__.py": "",
        "app/a.py": ("import http.client\n\nclass Quick(http.client.HTTPResponse):\n"
                     "    def _read_status(self):\n        return ('HTTP/1.1', 200, 'OK')\n"),
        "glue/__init__.py": "",
    })
    assert "app.a.Quick overrides http.client.HTTPResponse._read_status" in found
