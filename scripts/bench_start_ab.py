#!/usr/bin/env python
"""A change's effect on starts: first and later starts of one model, alternating between source trees.

    git worktree add /tmp/before <commit> && cp -r wsgi_infer/engine/kernels/lib /tmp/before/wsgi_infer/engine/kernels/
    cd /tmp && /work/main/.venv/bin/python /work/main/scripts/bench_start_ab.py MODEL.gguf /tmp/before /work/main

Each round, for each tree in turn (``PYTHONPATH``), a fresh cache: a first start, then a later start, each launch to
the first 200 on /health with the serving processes' peak RSS, memory backed before it as in ``bench_sizes.py``. Run
it from a directory that holds no ``wsgi_infer``: ``python -m`` (the process that reads a first start's text files
ahead) and gunicorn put the working directory first on the path, which would shadow the trees. Prints each round and
the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_sizes import SERVE, started  # noqa: E402


def _figures(row: list[float]) -> str:
    first, first_mb, later, later_mb = row
    return f"first {first:.2f} s {first_mb:.0f} MB, later {later:.2f} s {later_mb:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("trees", nargs="+", help="source trees, each a directory holding wsgi_infer")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    memory = 2 * args.model.stat().st_size + (2 << 30)
    results: dict[str, list[list[float]]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            with tempfile.TemporaryDirectory() as cache:
                env = os.environ | {"WSGI_INFER_CACHE_DIR": cache, "WSGI_INFER_MODEL": str(args.model)}
                env["PYTHONPATH"] = tree
                row = []
                for _which in ("first", "later"):
                    row += started(lambda port: [*SERVE, "--bind", f"127.0.0.1:{port}"], env, memory)
            results[tree].append(row)
            print(tree, _figures(row), flush=True)
    for tree, rows in results.items():
        medians = [statistics.median(column) for column in zip(*rows)]
        print("median", tree, _figures(medians))


if __name__ == "__main__":
    main()
