"""The tree's boundaries: what each module may import, from where it sits.

Each engine module, and each module the gunicorn master imports, is imported
alone in a fresh interpreter and its ``sys.modules`` is checked, so a rule also
catches what comes in through other modules. The other rules read the modules'
import statements instead (those under ``TYPE_CHECKING`` too, where a rule says
so): the server's layers, no import cycles, and that a route may well reach
gevent and the engine, but only through the manager, which ``sys.modules``
cannot tell. Each of these rules is shown to fail on a planted violation.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .package_layout import (
    ENGINE_CORE,
    ENGINE_VOCABULARY,
    LAYERS,
    MASTER_MODULES,
    MASTER_STEPS,
    NATIVE_THREADING,
    PACKAGE,
    SERVER_ONLY,
    plant,
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(subpackage: str) -> list[str]:
    return sorted(module_name(p) for p in (PACKAGE / subpackage).rglob("*.py"))


# Imports each named module in a child forked from this interpreter, after ``prewarm`` (torch and transformers
# for modules that import them anyway: they then cost one import, not one per module), and prints what each
# child's sys.modules held: as importing it alone in a fresh interpreter would show, at a fraction of the time.
PROBE = """
import importlib, json, os, sys
names, prewarm = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for package in prewarm:
    importlib.import_module(package)
found = {}
for name in names:
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        importlib.import_module(name)
        os.write(write, json.dumps(sorted(sys.modules)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        found[name] = json.loads(pipe.read())
    os.wait()
print(json.dumps(found))
"""
HEAVY = ("torch", "transformers")  # imported before the forks where the module imports them anyway


def probe(names: list[str], prewarm: tuple[str, ...]) -> dict[str, set[str]]:
    args = [sys.executable, "-c", PROBE, json.dumps(names), json.dumps(prewarm)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return {
        name: {n.split(".")[0] for n in found} | {n for n in found if n.startswith("wsgi_infer.")}
        for name, found in json.loads(out.stdout).items()
    }


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """Module name -> the top-level names in sys.modules after importing it alone (the torch-free ones from a
    clean interpreter; the rest after torch and transformers, which import nothing of the server stack)."""
    clean = list(ENGINE_CORE + MASTER_STEPS)
    clean += [f"wsgi_infer.server.{m}" for m in MASTER_MODULES]
    found = probe(clean, ())
    heavy = probe(["json", *(m for m in modules_under("engine") if m not in found)], HEAVY)
    assert not heavy.pop("json") & set(SERVER_ONLY), (
        "torch or transformers imports the server stack: prewarming would hide it"
    )
    return found | heavy


def test_the_engine_never_imports_the_server_stack(loaded):
    for name in modules_under("engine"):
        assert not loaded[name] & set(SERVER_ONLY), f"{name} imports {sorted(loaded[name] & set(SERVER_ONLY))}"
        assert not any(m.startswith("wsgi_infer.server") for m in loaded[name]), f"{name} imports the server"


def test_the_engine_core_imports_no_torch(loaded):
    for module in ENGINE_CORE + MASTER_STEPS:
        assert "torch" not in loaded[module], module


def test_what_the_gunicorn_master_imports_has_no_torch(loaded):
    for module in MASTER_MODULES:
        imported = loaded[f"wsgi_infer.server.{module}"]
        assert not {"torch", "transformers"} & imported, module
        engine = {m for m in imported if m.startswith("wsgi_infer.engine.")}
        engine -= {*ENGINE_CORE, *MASTER_STEPS}  # none imports torch
        assert not engine, module


def own_imports(path: Path, type_checking: bool = False) -> set[str]:
    """Absolute names of what a module imports itself: at run time, and with ``type_checking`` also under
    ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
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


def module_graph() -> dict[str, set[str]]:
    """Our modules -> the modules of ours each imports, ``TYPE_CHECKING`` ones included."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: own_imports(path, type_checking=True) & set(paths) - {name} for name, path in paths.items()}
    # `from package import module` names the package too, which it does not mean
    return {
        name: {n for n in imported if not any(m.startswith(n + ".") for m in imported)}
        for name, imported in graph.items()
    }


def layer_of(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return len(LAYERS)


def imports_from_above(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, imported in graph.items() for b in imported if layer_of(b) > layer_of(a))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


VIOLATIONS = {  # a stream log that reads a schema, and a schema that names it back, for type checking only; the
    # machine's runtime that reads the scheduler
    "server/streaming/planted.py": "from ..api.bodies.schemas import Request\n",
    "engine/runtime/planted.py": "from ..scheduling.scheduler import Scheduler\n",
    "server/api/bodies/schemas.py": "from typing import TYPE_CHECKING\n\n"
    "if TYPE_CHECKING:\n    from ...streaming import planted\n",
}


def test_each_layer_imports_only_from_below(tmp_path, monkeypatch):
    assert imports_from_above(module_graph()) == []
    plant(tmp_path, VIOLATIONS)  # the rule fails on a violation
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "wsgi_infer")
    assert imports_from_above(module_graph()) == [
        ("wsgi_infer.engine.runtime.planted", "wsgi_infer.engine.scheduling.scheduler"),
        ("wsgi_infer.server.streaming.planted", "wsgi_infer.server.api.bodies.schemas"),
    ]


def test_no_module_imports_itself_through_others_not_even_for_type_checking(tmp_path, monkeypatch):
    assert import_cycles(module_graph()) == []
    plant(tmp_path, VIOLATIONS)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "wsgi_infer")
    assert import_cycles(module_graph()) == [
        ["wsgi_infer.server.api.bodies.schemas", "wsgi_infer.server.streaming.planted"]
    ]


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
    manager = "wsgi_infer.server.engine_client.manager"
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
    assert touching == ["wsgi_infer.engine.runtime.native_threads", "wsgi_infer.server.engine_client.bridge"]


def imported_test_modules(path: Path) -> set[str]:
    """The test modules (``tests.**.test_*``) a file under tests/ imports: helpers belong in ``tests/support/``."""
    return {n for n in own_imports(path) if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_")}


def test_test_modules_import_helpers_never_each_other(tmp_path, monkeypatch):
    tests = PACKAGE.parent / "tests"
    assert {module_name(p): imported_test_modules(p) for p in tests.rglob("*.py")} == {
        module_name(p): set() for p in tests.rglob("*.py")
    }
    planted = tmp_path / "tests" / "api" / "test_planted.py"  # the rule fails on a violation
    planted.parent.mkdir(parents=True)
    planted.write_text("from ..engine.test_batching import run_alone\nfrom ..support.batch_runs import GREEDY\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "wsgi_infer")
    assert imported_test_modules(planted) == {"tests.engine.test_batching"}
