"""A wheel of Sluice carries what the code reads at run time: every Lua script
in the source tree, at the same package-relative path, byte for byte, in a
form Redis accepts, and every module that reads one at import time imports.

The editable install that development and the rest of the suite use reads the
source tree, so it cannot see a script left out of package-data. This test
builds a wheel, installs it into a fresh virtualenv outside the tree and
looks only at what was installed.

Nothing here names a package's Lua files or modules: they are found by walking
the packages that pyproject.toml's packages.find includes, so the test keeps
up when scripts move between packages."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import redis
from django.conf import settings

REPO_ROOT = Path(__file__).resolve().parents[1]

# Generated or machine-local; copying them into the build would let stale
# outputs (an old build/lib) leak into the wheel.
_NOT_SOURCE = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "var", "out")

# Subpackages that are not imported as part of the running code: migrations
# need the app registry's migration loader, management commands are entry
# points, __main__ runs a program.
_NOT_IMPORTED = {"migrations", "management", "__main__"}

# Runs under the fresh virtualenv's Python, from an empty directory, and
# reports on stdout as JSON; the assertions stay in the test so a failure
# reads as a diff.
_PROBE = textwrap.dedent('''
    import importlib, importlib.resources, json, pkgutil, sys, traceback

    request = json.load(sys.stdin)
    report = {"origins": {}, "scripts": {}, "import_errors": {}, "imported": []}

    for name in request["top_level"]:
        report["origins"][name] = importlib.import_module(name).__file__

    for rel_path, (package, name) in request["scripts"].items():
        resource = importlib.resources.files(package).joinpath(name)
        report["scripts"][rel_path] = resource.read_text() if resource.is_file() else None

    import django
    django.setup()

    def walk(package_name):
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__):
            if info.name in request["not_imported"]:
                continue
            full = f"{package_name}.{info.name}"
            try:
                importlib.import_module(full)
                report["imported"].append(full)
            except Exception:
                report["import_errors"][full] = traceback.format_exc()
                continue
            if info.ispkg:
                walk(full)

    for name in request["top_level"]:
        walk(name)

    json.dump(report, sys.stdout)
''')


def _top_level_packages() -> list[str]:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.split("*")[0].rstrip(".") for pattern in patterns})


def _source_scripts(top_level: list[str]) -> dict[str, Path]:
    """Every .lua file under the packages, keyed by its path from the repo root."""
    scripts = {}
    for name in top_level:
        for path in sorted((REPO_ROOT / name).rglob("*.lua")):
            rel = path.relative_to(REPO_ROOT)
            if not {"build", "__pycache__"} & set(rel.parts) and not any(p.startswith(".") for p in rel.parts):
                scripts[rel.as_posix()] = path
    return scripts


def _source_modules(top_level: list[str]) -> list[str]:
    """Dotted names of the modules and subpackages below the top-level
    packages that the probe should import."""
    modules = set()
    for name in top_level:
        for path in (REPO_ROOT / name).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if len(parts) > 1 and not _NOT_IMPORTED & set(parts) and "__pycache__" not in parts:
                modules.add(".".join(parts))
    return sorted(modules)


def _require_wheel_builder() -> None:
    """The wheel is built offline (--no-build-isolation), so this interpreter's
    setuptools must build wheels itself: bdist_wheel is part of setuptools
    from 70.1 (the test extra asks for it), before that it needs `wheel`."""
    import setuptools

    version = tuple(int(part) for part in setuptools.__version__.split(".")[:2])
    if version >= (70, 1) or importlib.util.find_spec("wheel") is not None:
        return
    message = (f"setuptools {setuptools.__version__} without `wheel` cannot build a wheel offline: "
               "pip install -e '.[test]' (make install does)")
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=240, **kwargs)
    assert result.returncode == 0, f"{args} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The Python of a fresh virtualenv outside the tree that holds the built
    wheel and reaches third-party dependencies through this interpreter's
    site-packages, without downloading anything."""
    _require_wheel_builder()
    work = tmp_path_factory.mktemp("packaging")

    # given: a wheel built from a copy of the tree, so the build reuses no
    # build/ directory and writes no egg-info into the developer's checkout
    source = work / "source"
    shutil.copytree(REPO_ROOT, source, ignore=_NOT_SOURCE)
    wheels = work / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--quiet", "-w", str(wheels), str(source)])
    (wheel,) = wheels.glob("sluice-*.whl")

    # and: installed into a virtualenv that has never seen the source tree
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--quiet", str(wheel)])

    # Dependencies come from the directories on this interpreter's sys.path
    # (its site-packages), added after the install so pip never sees the
    # editable sluice there. A .pth path line only extends sys.path: the .pth
    # files inside that directory, among them the editable-install hook that
    # maps our packages onto a source tree, are not executed, and the source
    # tree itself is left out, so only the wheel's copy is importable.
    venv_site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    # (The project's .venv may sit inside the checkout: a site-packages
    # directory is kept wherever it is; any other path inside the checkout,
    # the checkout itself above all, is not.)
    dependency_dirs = dict.fromkeys(
        entry for entry in sys.path
        if entry and Path(entry).is_dir()
        and (Path(entry).name == "site-packages" or not Path(entry).resolve().is_relative_to(REPO_ROOT))
    )
    Path(venv_site, "sluice-test-dependencies.pth").write_text("".join(f"{d}\n" for d in dependency_dirs))
    return python


def test_wheel_ships_every_lua_script_and_its_readers_import(installed, tmp_path, redis_client):
    top_level = _top_level_packages()
    scripts = _source_scripts(top_level)
    assert scripts, f"no .lua files found under {top_level}: the walk is broken"
    for rel_path in scripts:
        # A directory without __init__.py is not a regular package; Django and
        # importlib.resources should see the same package tree as setuptools.
        for parent in Path(rel_path).parents[:-1]:
            assert (REPO_ROOT / parent / "__init__.py").is_file(), f"{parent}/ holds {rel_path} but has no __init__.py"

    # when: the installed copy is probed from outside the tree
    request = {
        "top_level": top_level,
        "scripts": {rel: [".".join(Path(rel).parent.parts), Path(rel).name] for rel in scripts},
        "not_imported": sorted(_NOT_IMPORTED),
    }
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"}}
    env.update({"DJANGO_SETTINGS_MODULE": "llm_platform.settings", "REDIS_URL": settings.REDIS_URL,
                "SLUICE_VAR_DIR": str(tmp_path / "var")})
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    probe = _run([str(installed), "-c", _PROBE], input=json.dumps(request), cwd=run_dir, env=env)
    report = json.loads(probe.stdout)

    # then: every package comes from the virtualenv, not the source tree
    venv_root = installed.parent.parent.resolve()
    for name, origin in report["origins"].items():
        assert Path(origin).resolve().is_relative_to(venv_root), f"{name} imported from {origin}, not the wheel"

    # and: every script is there, unchanged, and Redis compiles it
    missing = sorted(rel for rel, text in report["scripts"].items() if text is None)
    assert missing == [], f"the wheel lacks {missing}"
    for rel_path, path in scripts.items():
        assert report["scripts"][rel_path] == path.read_text(), f"installed {rel_path} differs from the source"
        try:
            redis_client.script_load(report["scripts"][rel_path])
        except redis.ResponseError as error:
            pytest.fail(f"Redis rejects {rel_path}: {error}")

    # and: every module imports, including those that read a script at import
    failures = {module: trace.strip().splitlines()[-1] for module, trace in report["import_errors"].items()}
    assert failures == {}, "\n\n".join(report["import_errors"].values())
    assert sorted(report["imported"]) == _source_modules(top_level)
