"""What a model's load imports, seen in a fresh interpreter: the modules ``load_imports`` names, imported first as the
server's hub imports them, and none beyond them while the model loads and generates."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def assert_a_load_imports_only_what_load_imports_names(
    path: Path, env: Mapping[str, str], absent: tuple[str, ...] = ()
) -> None:
    """Loading the GGUF at ``path`` imports no module of transformers or gguf-py beyond those ``load_imports`` names,
    and none of ``absent`` is imported at all."""
    code = (
        "import importlib, sys\n"
        "from wsgi_infer.engine.loading.model_loader import load_imports\n"
        f"for module in load_imports({str(path)!r}): importlib.import_module(module)\n"
        "before = set(sys.modules)\n"
        f"from wsgi_infer import LLM; LLM(model={str(path)!r}).generate('Hi')\n"
        "new = sorted(m for m in set(sys.modules) - before if m.startswith(('transformers', 'gguf')))\n"
        "assert not new, new\n"
        f"present = [m for m in {absent!r} if m in sys.modules]\n"
        "assert not present, present"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=dict(env))
