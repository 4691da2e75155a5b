"""The tree's shape: no module, C source, script or test over 300 lines, no folder of more than 15 modules; and no name
that a rename left stale where nothing else would notice: what the scripts import, the modules the suite's start
order names; and every script run as a program answers ``--help`` without running. Each rule but the start order's
is shown to fail on a planted violation as well as to pass on the tree.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from .package_layout import PACKAGE, plant


def long_sources(root: Path) -> list[str]:
    """The package's modules, C sources, scripts and tests under ``root`` over 300 lines, as paths relative to it."""
    folders = (root / "wsgi_infer", root / "scripts", root / "tests")
    sources = (p for folder in folders for p in folder.rglob("*") if p.suffix in (".py", ".c", ".h"))
    return sorted(p.relative_to(root).as_posix() for p in sources if len(p.read_text().splitlines()) > 300)


def test_no_module_is_over_300_lines_not_a_c_source_a_script_or_a_test(tmp_path):
    assert long_sources(PACKAGE.parent) == []
    planted = ("wsgi_infer/server/api/planted.py", "wsgi_infer/engine/kernels/c/planted.h", "scripts/x.py")
    for path in (*planted, "tests/conftest.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("\n" * 301)
    (tmp_path / "scripts" / "short.py").write_text("\n" * 300)
    assert long_sources(tmp_path) == [
        "scripts/x.py",
        "tests/conftest.py",
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


def test_the_suites_start_order_names_test_modules_that_exist():
    """The suite's scheduling lists (tests/plugins/scheduling.py: whole-machine modules, the longest first) go stale
    silently on a rename."""
    from .plugins.scheduling import LONGEST_FIRST, WHOLE_MACHINE

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


def scripts_without_a_command_line(scripts: Path) -> list[str]:
    """The scripts run as programs (a ``__main__`` block) that parse no command line with argparse: ``--help`` runs
    them (screenshot_chat.py started a server and rewrote the README's picture)."""
    programs = {path.name: path.read_text() for path in sorted(scripts.glob("*.py"))}
    runs = [name for name, text in programs.items() if '__name__ == "__main__"' in text]
    return [name for name in runs if "ArgumentParser(" not in programs[name]]


def test_every_script_run_as_a_program_parses_its_command_line(tmp_path):
    assert scripts_without_a_command_line(PACKAGE.parent / "scripts") == []
    main = 'if __name__ == "__main__":\n    '
    (tmp_path / "parses.py").write_text(f"import argparse\n\n{main}argparse.ArgumentParser().parse_args()\n")
    (tmp_path / "runs.py").write_text(f"{main}print('rewrites a file')\n")
    (tmp_path / "helper.py").write_text("def helper():\n    pass\n")  # imported by others, never run
    assert scripts_without_a_command_line(tmp_path) == ["runs.py"]
