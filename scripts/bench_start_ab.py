#!/usr/bin/env python
"""A change's effect on starts: first and later starts of one model, alternating between source trees.

    git worktree add /tmp/before <commit> && cp -r wsgi_infer/engine/kernels/lib /tmp/before/wsgi_infer/engine/kernels/
    cd /tmp && /work/main/.venv/bin/python /work/main/scripts/bench_start_ab.py MODEL.gguf /tmp/before /work/main

Each round, for each tree in turn (``PYTHONPATH``), ``bench_sizes.py``'s starts: a fresh cache, a first start, then a
later start, each launch to the first 200 on /health with the serving processes' peak RSS, memory backed before it. Run
it from a directory that holds no ``wsgi_infer``: ``python -m`` (the process that reads a first start's text files
ahead) and gunicorn put the working directory first on the path, which would shadow the trees. Prints each round and
the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_sizes import starts  # noqa: E402


def _figures(row: list[float]) -> str:
    first, first_mb, later, later_mb = row
    return f"first {first:.2f} s {first_mb:.0f} MB, later {later:.2f} s {later_mb:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("trees", nargs="+", help="source trees, each a directory holding wsgi_infer")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    results: dict[str, list[list[float]]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            os.environ["PYTHONPATH"] = tree  # what bench_sizes' starts run with
            figures = starts(args.model, {}, 0)
            row = [figures[f"{which}_start_{unit}"] for which in ("first", "later") for unit in ("s", "rss_mb")]
            results[tree].append(row)
            print(tree, _figures(row), flush=True)
    for tree, rows in results.items():
        medians = [statistics.median(column) for column in zip(*rows)]
        print("median", tree, _figures(medians))


if __name__ == "__main__":
    main()
