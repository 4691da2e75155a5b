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
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wsgi_infer"
SERVER_ONLY = ("gevent", "flask", "pydantic", "prometheus_client", "gunicorn")
# The engine's torch-free core: its vocabulary, the scheduling, and the runtime's plain-Python parts.
ENGINE_CORE = (
    "wsgi_infer.engine.config",
    "wsgi_infer.engine.sampling_params",
    "wsgi_infer.engine.outputs",
    "wsgi_infer.engine.messages",
    "wsgi_infer.engine.scheduling.sequence",
    "wsgi_infer.engine.scheduling.block_manager",
    "wsgi_infer.engine.scheduling.kv_cache_manager",
    "wsgi_infer.engine.scheduling.scheduler",
    "wsgi_infer.engine.scheduling.step_budget",
    "wsgi_infer.engine.runtime.cpu_share",
    "wsgi_infer.engine.runtime.step_interrupt",
    "wsgi_infer.engine.text.bad_words",
    "wsgi_infer.engine.text.chat_template",
    "wsgi_infer.engine.text.token_pieces",
    "wsgi_infer.engine.text.truncation",
)
MASTER_MODULES = ("gunicorn.worker", "gunicorn.config", "gunicorn.logger", "settings")
# The server's layers, lowest first: a module imports only from its own layer and those below it. Modules in no
# layer (the package roots, the command line, offline generation) sit above them all.
# The engine's own layers come first: its vocabulary; the machine it runs on; text and token ids; the kernels, the
# network's layers and the models; loading them; scheduling; sampling; and at its root the runner, the engines and
# the thread's loop, which tie them together.
ENGINE_LAYERS = (
    ("wsgi_infer.engine.config", "wsgi_infer.engine.sampling_params", "wsgi_infer.engine.outputs"),
    ("wsgi_infer.engine.runtime",),
    ("wsgi_infer.engine.text",),
    ("wsgi_infer.engine.kernels",),
    ("wsgi_infer.engine.layers",),
    ("wsgi_infer.engine.models",),
    ("wsgi_infer.engine.loading",),
    ("wsgi_infer.engine.scheduling",),
    ("wsgi_infer.engine.sampling",),
    ("wsgi_infer.engine",),
)
LAYERS = (
    *ENGINE_LAYERS,
    (
        "wsgi_infer.server.client_connection",
        "wsgi_infer.server.errors",
        "wsgi_infer.server.metrics",
        "wsgi_infer.server.settings",
        "wsgi_infer.server.model_specs",
    ),
    ("wsgi_infer.server.streaming",),
    ("wsgi_infer.server.engine_client",),
    ("wsgi_infer.server.tenants",),
    # the API: what every route shares, a conversation's path, then the routes and their API families
    (
        "wsgi_infer.server.api.access",
        "wsgi_infer.server.api.continuation",
        "wsgi_infer.server.api.serving",
        "wsgi_infer.server.api.bodies",
    ),
    ("wsgi_infer.server.api.chat",),
    ("wsgi_infer.server.api",),
    ("wsgi_infer.server.app", "wsgi_infer.server.wsgi"),
    ("wsgi_infer.server.gunicorn",),
)
# Plain data the server speaks to the engine with, and the text side's torch-free steps the front end runs on the
# engine's tokenizer (a chat's prompt, a prompt truncated, bad words, a token's text); routes use them freely.
ENGINE_VOCABULARY = (
    "wsgi_infer.engine",
    "wsgi_infer.engine.config",
    "wsgi_infer.engine.sampling_params",
    "wsgi_infer.engine.outputs",
    "wsgi_infer.engine.messages",
    "wsgi_infer.engine.text.bad_words",
    "wsgi_infer.engine.text.chat_template",
    "wsgi_infer.engine.text.token_pieces",
    "wsgi_infer.engine.text.truncation",
)
# Torch-free engine steps the gunicorn master starts before it forks workers: the CPU kernels' build where none are
# installed, and a process that reads GGUFs' text files ahead of their conversion (``text_files_ahead``).
MASTER_STEPS = (
    "wsgi_infer.engine.loading.gguf_config",
    "wsgi_infer.engine.loading.gguf_file",
    "wsgi_infer.engine.loading.gguf_header",
    "wsgi_infer.engine.loading.gguf_tokenizer",
    "wsgi_infer.engine.loading.model_paths",
    "wsgi_infer.engine.loading.resolved_config",
    "wsgi_infer.engine.loading.row_orders",
    "wsgi_infer.engine.loading.text_files",
    "wsgi_infer.engine.loading.vocabulary_merges",
    "wsgi_infer.engine.text.builtin_chat_templates",
    "wsgi_infer.engine.kernels",
    "wsgi_infer.engine.kernels.build",
    "wsgi_infer.engine.kernels.variants",
    "wsgi_infer.engine.runtime",
    "wsgi_infer.engine.runtime.cache_files",
    "wsgi_infer.engine.runtime.cpu_info",
    "wsgi_infer.engine.runtime.cpu_budget",  # and, in each worker, the threads the engine gets
)
NATIVE_THREADING = ("_thread", "_queue", "threading", "gevent.monkey", "gevent.threadpool", "concurrent.futures")


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


def plant(root: Path, files: dict[str, str]) -> None:
    """A copy of the package's tree in ``root`` with ``files`` (paths under wsgi_infer/) written into it."""
    for path in PACKAGE.rglob("*.py"):
        copy = root / path.relative_to(PACKAGE.parent)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    for relative, text in files.items():
        (root / "wsgi_infer" / relative).write_text(text)


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


def long_sources(root: Path) -> list[str]:
    """The package's modules, C sources and scripts under ``root`` over 300 lines, as paths relative to it."""
    folders = (root / "wsgi_infer", root / "scripts")
    sources = (p for folder in folders for p in folder.rglob("*") if p.suffix in (".py", ".c", ".h"))
    return sorted(p.relative_to(root).as_posix() for p in sources if len(p.read_text().splitlines()) > 300)


def test_no_module_is_over_300_lines_not_even_a_c_source_or_a_script(tmp_path):
    assert long_sources(PACKAGE.parent) == []
    for planted in ("wsgi_infer/server/api/planted.py", "wsgi_infer/engine/kernels/c/planted.h", "scripts/x.py"):
        (tmp_path / planted).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / planted).write_text("\n" * 301)
    (tmp_path / "scripts" / "short.py").write_text("\n" * 300)
    assert long_sources(tmp_path) == [
        "scripts/x.py",
        "wsgi_infer/engine/kernels/c/planted.h",
        "wsgi_infer/server/api/planted.py",
    ]


MAX_MODULES_PER_FOLDER = 15


def crowded_folders(root: Path) -> dict[str, int]:
    """Folders under ``root`` holding more than MAX_MODULES_PER_FOLDER modules side by side."""
    counts: dict[str, int] = {}
    for path in root.rglob("*.py"):
        if path.name != "__init__.py":
            folder = path.parent.relative_to(root.parent).as_posix()
            counts[folder] = counts.get(folder, 0) + 1
    return {folder: n for folder, n in counts.items() if n > MAX_MODULES_PER_FOLDER}


def test_no_folder_holds_more_than_15_modules(tmp_path):
    assert crowded_folders(PACKAGE) == {}
    assert crowded_folders(PACKAGE.parent / "tests") == {}
    plant(tmp_path, {f"engine/runtime/planted_{i}.py": "" for i in range(MAX_MODULES_PER_FOLDER)})
    assert list(crowded_folders(tmp_path / "wsgi_infer")) == ["wsgi_infer/engine/runtime"]


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


def test_the_suites_start_order_names_test_modules_that_exist():
    """conftest.py's scheduling lists (whole-machine modules, the longest first) go stale silently on a rename."""
    from .conftest import LONGEST_FIRST, WHOLE_MACHINE

    modules = {path.stem for path in (PACKAGE.parent / "tests").rglob("test_*.py")}
    assert set(WHOLE_MACHINE) | set(LONGEST_FIRST) <= modules
    assert not set(WHOLE_MACHINE) & set(LONGEST_FIRST) and len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def top_level_names(tree: ast.Module) -> set[str]:
    """What a module defines at its top level: functions, classes, assigned and imported names."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved_script_imports(scripts: Path) -> list[str]:
    """What the scripts import from our package, the tests' helpers or each other that does not exist: run by hand,
    not by the suite, a script broken by a rename stays broken unseen (screenshot_chat.py imported a module removed
    since)."""
    missing = []
    trees = {path.stem: ast.parse(path.read_text()) for path in sorted(scripts.glob("*.py"))}
    for name, tree in trees.items():
        path = scripts / f"{name}.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in trees:  # a neighbour: what it defines
                defined = top_level_names(trees[node.module])
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name not in defined]
                continue
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("wsgi_infer", "tests")):
                continue
            try:
                module = importlib.import_module(node.module)
            except ModuleNotFoundError:
                missing.append(f"{path.name}: {node.module}")
                continue
            missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    return missing


def test_every_script_imports_what_exists(tmp_path):
    assert unresolved_script_imports(PACKAGE.parent / "scripts") == []
    (tmp_path / "planted.py").write_text(
        "from tests.support.gone import CHROMIUM\nfrom tests.support.server import GunicornServer, Gone\n"
        "from helper import IK_NAME, free_port, healthy, Path\n"
    )
    (tmp_path / "helper.py").write_text("from pathlib import Path\nIK_NAME = 'ik'\n\ndef free_port():\n    pass\n")
    assert unresolved_script_imports(tmp_path) == [
        "planted.py: tests.support.gone",
        "planted.py: tests.support.server.Gone",
        "planted.py: helper.healthy",
    ]
