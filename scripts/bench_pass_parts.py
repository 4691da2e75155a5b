#!/usr/bin/env python
"""What each part of a K-quant's packed pass costs, by removal: builds of the kernels' source with one part taken out
each (timing only: their results are wrong), against the source as it is, side by side in ``bench_gemm.py``.

A part whose removal speeds the pass by x% costs at most that much of it; one that gains nothing was not what bound
it. The removals are text edits of today's source, each checked to apply once (a source that changed fails here
rather than timing something else). Example, the AVX2 build on any x86 CPU with AVX2:

    .venv/bin/python scripts/bench_pass_parts.py --rounds 5
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from wsgi_infer.engine.kernels import variants

SOURCE = Path(variants.__file__).with_name("c")
KEEP_ALIVE = "for (int h = 0; h < parts; h++) for (int r = 0; r < rows; r++) acc[h][r] += to_f(isb[h][r]);"
# each removal: (file, text, replacement)
REMOVALS: dict[str, list[tuple[str, str, str]]] = {
    "as it is": [],
    "no activation prefetch": [
        ("register_passes.h", "#define ACT_AHEAD (QL == 8 ? 4 : 0)", "#define ACT_AHEAD 0"),
    ],
    "no super-block totals": [  # Q4_K's integer sums added to the outputs as they are, so that they stay computed
        (
            "register_passes.h",
            "            if (integer_sums(type, planes))\n                for (int h = 0; h < parts; h++)",
            f"            if (integer_sums(type, planes) && type == Q4_K)\n                {KEEP_ALIVE}\n"
            "            else if (integer_sums(type, planes))\n                for (int h = 0; h < parts; h++)",
        )
    ],
    "no minimums' term": [
        (
            "k_sums.h",
            "    if (type != Q6_K) {\n        ivec m = {0};",
            "    if (type == Q5_K) {\n        ivec m = {0};",
        ),
    ],
    "no widening multiply": [
        ("dot_products.h", "lo[r] += madd16((ivec)sum[r], by[first / 4]);", "lo[r] += (ivec)sum[r];"),
    ],
}


def build(name: str, edits: list[tuple[str, str, str]], flags: tuple[str, ...], work: Path) -> Path:
    source = work / name.replace(" ", "-").replace("'", "")
    shutil.copytree(SOURCE, source)
    for file, text, replacement in edits:
        code = (source / file).read_text()
        if code.count(text) != 1:
            sys.exit(f"{name}: {file} no longer has the text this removal edits")
        (source / file).write_text(code.replace(text, replacement))
    library = source.with_suffix(".so")
    sources = sorted(str(path) for path in source.glob("*.c"))
    subprocess.run(["cc", *variants.COMMON_FLAGS, *flags, *sources, "-o", str(library), "-lm"], check=True)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="avx2", help="the build's flags, as variants.py names them")
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K"])
    parser.add_argument("--rows", default="512")
    parser.add_argument("--rounds", default="5")
    args = parser.parse_args()
    flags = next(v.flags for v in variants.X86_VARIANTS if v.name == args.variant)
    with tempfile.TemporaryDirectory(prefix="pass-parts.") as work:
        libraries = [str(build(name, edits, flags, Path(work))) for name, edits in REMOVALS.items()]
        bench = Path(__file__).with_name("bench_gemm.py")
        command = [sys.executable, str(bench), *libraries, "--formats", *args.formats, "--rows", args.rows]
        subprocess.run([*command, "--rounds", args.rounds], check=True)


if __name__ == "__main__":
    main()
