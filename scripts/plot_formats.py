#!/usr/bin/env python
"""One picture of several `bench_serve.py --json` runs: output tok/s per model file, one panel per concurrency,
a bar per system, and each peer's ratio to wsgi-infer above its bar pair. Example:

    .venv/bin/python scripts/plot_formats.py Q4_1=q4_1.json Q8_0=q8_0.json --out docs/formats.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="LABEL=JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = (run.split("=", 1) for run in args.runs)
    runs = {label: json.loads(Path(path).read_text())["systems"] for label, path in pairs}
    first = next(iter(runs.values()))
    systems, levels = list(first), list(first["wsgi-infer"])
    fig, panels = plt.subplots(1, len(levels), figsize=(5 * len(levels), 4), squeeze=False)
    width = 0.8 / len(systems)
    for panel, level in zip(panels[0], levels):
        for i, system in enumerate(systems):
            values = [runs[label][system][level]["output_tok_s"] for label in runs]
            panel.bar([x + i * width for x in range(len(runs))], values, width, label=system)
        for x, label in enumerate(runs):
            ours = runs[label]["wsgi-infer"][level]["output_tok_s"]
            peers = [runs[label][s][level]["output_tok_s"] for s in systems if s != "wsgi-infer"]
            top = max([ours, *peers])
            ratios = " ".join(f"{ours / p:.2f}×" for p in peers)
            panel.annotate(ratios, (x + width * (len(systems) - 1) / 2, top), ha="center", va="bottom", fontsize=9)
        panel.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(runs))], list(runs))
        panel.set_title(f"{level} concurrent stream{'s' if level != '1' else ''}")
        panel.set_ylabel("output tok/s")
        panel.margins(y=0.15)
        panel.grid(axis="y", alpha=0.3)
        panel.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
