"""The tree's boundaries: what each module may import, from where it sits.

Each engine module, and each module the gunicorn master imports, is imported
alone in a fresh interpreter and its ``sys.modules`` is checked, so a rule also
catches what comes in through other modules. The last two rules read the
modules' import statements instead: a route may well reach gevent and the
engine, but only through the manager, which ``sys.modules`` cannot tell.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wsgi_infer"
SERVER_ONLY = ("gevent", "flask", "pydantic", "prometheus_client", "gunicorn")
ENGINE_CORE = (
    "config",
    "sampling_params",
    "outputs",
    "sequence",
    "block_manager",
    "scheduler",
    "cpu_share",
    "step_interrupt",
)
MASTER_MODULES = ("worker", "gunicorn_config", "gunicorn_logging", "settings")
# Plain data the server speaks to the engine with; routes use it freely.
ENGINE_VOCABULARY = (
    "wsgi_infer.engine",
    "wsgi_infer.engine.config",
    "wsgi_infer.engine.sampling_params",
    "wsgi_infer.engine.outputs",
)
# Torch-free engine steps the gunicorn master runs before it forks workers: starting the CPU kernels' build.
MASTER_STEPS = (
    "wsgi_infer.engine.kernels",
    "wsgi_infer.engine.kernels.build",
    "wsgi_infer.engine.cache_files",
    "wsgi_infer.engine.cpu_info",
    "wsgi_infer.engine.cpu_budget",  # and, in each worker, the threads the engine gets
)
NATIVE_THREADING = ("_thread", "_queue", "threading", "gevent.monkey", "gevent.threadpool", "concurrent.futures")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(subpackage: str) -> list[str]:
    return sorted(module_name(p) for p in (PACKAGE / subpackage).rglob("*.py"))


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """Module name -> the top-level names in sys.modules after importing it alone."""
    script = "import importlib, json, sys; importlib.import_module(sys.argv[1]); print(json.dumps(sorted(sys.modules)))"

    def imports_of(name: str) -> set[str]:
        out = subprocess.run([sys.executable, "-c", script, name], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"importing {name} failed:\n{out.stderr}"
        names = json.loads(out.stdout)
        return {n.split(".")[0] for n in names} | {n for n in names if n.startswith("wsgi_infer.")}

    names = modules_under("engine") + [f"wsgi_infer.server.{m}" for m in MASTER_MODULES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(names, pool.map(imports_of, names)))


def test_the_engine_never_imports_the_server_stack(loaded):
    for name in modules_under("engine"):
        assert not loaded[name] & set(SERVER_ONLY), f"{name} imports {sorted(loaded[name] & set(SERVER_ONLY))}"
        assert not any(m.startswith("wsgi_infer.server") for m in loaded[name]), f"{name} imports the server"


def test_the_engine_core_imports_no_torch(loaded):
    for module in [f"wsgi_infer.engine.{m}" for m in ENGINE_CORE] + list(MASTER_STEPS):
        assert "torch" not in loaded[module], module


def test_what_the_gunicorn_master_imports_has_no_torch(loaded):
    for module in MASTER_MODULES:
        imported = loaded[f"wsgi_infer.server.{module}"]
        assert not {"torch", "transformers"} & imported, module
        engine = {m for m in imported if m.startswith("wsgi_infer.engine.")}
        engine -= {"wsgi_infer.engine.config", *MASTER_STEPS}
        assert not engine, module


def own_imports(path: Path) -> set[str]:
    """Absolute names of what a module imports itself, at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def reachable_imports(start: str, graph: dict[str, set[str]], stop: str) -> set[str]:
    """Everything ``start`` imports at run time, following our own modules but not through ``stop``."""
    seen, todo, names = {start}, [start], set()
    while todo:
        for name in graph[todo.pop()]:
            names.add(name)
            if name in graph and name not in seen and name != stop:
                seen.add(name)
                todo.append(name)
    return names


def test_only_the_manager_brings_gevent_and_the_engine_together():
    """Beyond the engine's data types, nothing reaches both the engine and gevent except via the manager."""
    graph = {module_name(path): own_imports(path) for path in PACKAGE.rglob("*.py")}
    manager = "wsgi_infer.server.manager"
    both = []
    for name in graph:
        names = reachable_imports(name, graph, stop=manager)
        engine = {
            n
            for n in names
            if n.startswith("wsgi_infer.engine")
            and n not in ENGINE_VOCABULARY + MASTER_STEPS
            and n.rsplit(".", 1)[0] not in ENGINE_VOCABULARY + MASTER_STEPS
        }
        if engine and any(n.split(".")[0] == "gevent" for n in names):
            both.append(name)
    assert both == [manager]


def test_only_the_bridge_touches_native_threads():
    touching = sorted(
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if any(n == t or n.startswith(t + ".") for n in own_imports(path) for t in NATIVE_THREADING)
    )
    assert touching == ["wsgi_infer.server.bridge"]


def imported_test_modules(path: Path) -> set[str]:
    """The test modules (tests.test_*) a file under tests/ imports: helpers belong in modules of their own."""
    return {n for n in own_imports(path) if n.startswith("tests.test_") and n.count(".") == 1}


def test_test_modules_import_helpers_never_each_other(tmp_path, monkeypatch):
    tests = PACKAGE.parent / "tests"
    assert {module_name(p): imported_test_modules(p) for p in tests.glob("*.py")} == {
        module_name(p): set() for p in tests.glob("*.py")
    }
    planted = tmp_path / "tests" / "test_planted.py"  # the rule fails on a violation
    planted.parent.mkdir()
    planted.write_text("from .test_batching import run_alone\nfrom .batch_runs import GREEDY\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "wsgi_infer")
    assert imported_test_modules(planted) == {"tests.test_batching"}
