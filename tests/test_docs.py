"""The front page and docs/: the README stays short, every relative link reaches a file, the README's two
commands are the ones CI runs, every script a page's code (or a shell script of scripts/) calls takes the options it
is given, and the benchmark pages show where things stand, their history left to git.

Each rule is a function of the text it reads, shown to fail on a planted violation as well as to pass on the tree.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARK_PAGES = (ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs" / "benchmarks").glob("*.md")))
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")), *BENCHMARK_PAGES)
CI = ROOT / ".ci" / "run"
MAX_README_LINES = 200
# a benchmark page is each CPU's latest figures and what they rest on, not every session's entries (git keeps those)
MAX_BENCHMARK_PAGE_LINES = 300

SERVE = "bash scripts/setup.sh && .venv/bin/wsgi-infer serve"
TEST_SETUP = "bash scripts/setup.sh --test"
PYTEST = ".venv/bin/python -m pytest"

# [text](target) and ![alt](target), with an optional "title"; code blocks and code spans hold no links.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCED = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`]+`")
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
# `scripts/NAME.py` and what follows it on its line; an option; a quoted argument (a peer's options, passed through)
SCRIPT_CALL = re.compile(r"scripts/(\w+)\.py\b([^|;&>`\n]*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def relative_links(text: str) -> list[str]:
    """The targets of a page's links and images, less web addresses and anchors within the page."""
    text = CODE_SPAN.sub("", FENCED.sub("", text))
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "#"))]


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose path (without its #fragment) is no file or folder of the tree."""
    return [t for t in relative_links(page.read_text()) if not (page.parent / t.split("#", 1)[0]).exists()]


def bash_commands(text: str) -> list[str]:
    """The lines of a page's ```bash blocks."""
    return [line.strip() for block in BASH_BLOCK.findall(text) for line in block.splitlines() if line.strip()]


def ci_mismatches(readme: str, ci_script: str) -> list[str]:
    """What of the README's two commands CI does not run as written: the serve command missing, or the test
    command's setup or pytest part not a line of the CI script."""
    commands = bash_commands(readme)
    problems = [] if SERVE in commands else [f"the README has no `{SERVE}`"]
    tests = [c for c in commands if c.startswith(f"{TEST_SETUP} && {PYTEST}")]
    if len(tests) != 1:
        return [*problems, f"the README has {len(tests)} test commands (`{TEST_SETUP} && {PYTEST} ...`)"]
    ci_lines = {line.strip() for line in ci_script.splitlines()}
    return problems + [f"CI does not run `{part}`" for part in tests[0].split(" && ", 1) if part not in ci_lines]


def script_calls(text: str) -> list[tuple[str, str]]:
    """The calls of ``scripts/NAME.py`` in a page's code (blocks, continued lines joined, and spans): each script's
    name and what follows it on its line."""
    code = [m[0].replace("\\\n", " ") for m in FENCED.finditer(text)] + CODE_SPAN.findall(FENCED.sub("", text))
    return [call for piece in code for call in SCRIPT_CALL.findall(piece)]


def unknown_script_options(text: str, scripts: Path) -> list[str]:
    """The calls of a page whose script is gone or never names an option they give it (argparse's names are string
    literals of its source): a command a reader copies from the page and that fails."""
    problems = []
    for name, arguments in script_calls(text):
        script = scripts / f"{name}.py"
        if not script.is_file():
            problems.append(f"scripts/{name}.py: no such script")
            continue
        source = script.read_text()
        unknown = [o for o in OPTION.findall(QUOTED.sub("", arguments)) if f'"{o}"' not in source]
        problems += [f"scripts/{name}.py {option}: not an option of the script" for option in unknown]
    return problems


def test_every_script_a_page_calls_takes_the_options_it_is_given():
    scripts = ROOT / "scripts"
    assert sum(len(script_calls(page.read_text())) for page in PAGES) > 50, "the pages' calls not found?"
    assert {page.name: unknown_script_options(page.read_text(), scripts) for page in PAGES} == {
        page.name: [] for page in PAGES
    }

    planted = (  # the rule fails on a violation, and only there: a misspelt option, a script that is gone
        "```bash\n.venv/bin/python scripts/bench_serve.py --concurrency 1 \\\n    --concurency 16 "
        "--llama-variant 'x=--spec-type ngram' | tee log\n```\nand `scripts/bench_gone.py --rounds 2`, "
        "`scripts/bench_gemm.py --rows 512`\n"
    )
    assert unknown_script_options(planted, scripts) == [
        "scripts/bench_serve.py --concurency: not an option of the script",
        "scripts/bench_gone.py: no such script",
    ]


def test_every_script_a_shell_script_calls_takes_the_options_it_is_given():
    """The shell drivers (the peers' benchmarks, the fuzzing) call the Python scripts as a page's code does."""
    scripts = ROOT / "scripts"
    texts = {path.name: f"```bash\n{path.read_text()}```" for path in scripts.glob("*.sh")}
    assert len(script_calls(texts["bench_peers.sh"])) >= 8, "its calls not found?"
    assert {name: unknown_script_options(text, scripts) for name, text in texts.items()} == {name: [] for name in texts}


def test_the_readme_is_at_most_200_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move reference into docs/"


def long_pages(pages: tuple[Path, ...], most: int) -> dict[str, int]:
    """The pages of more than ``most`` lines, with their line counts."""
    counts = {page.name: len(page.read_text().splitlines()) for page in pages}
    return {name: lines for name, lines in counts.items() if lines > most}


def test_every_benchmark_page_shows_where_things_stand_in_at_most_300_lines(tmp_path):
    assert len(BENCHMARK_PAGES) > 5 and long_pages(BENCHMARK_PAGES, MAX_BENCHMARK_PAGE_LINES) == {}

    short, log = tmp_path / "short.md", tmp_path / "log.md"  # the rule fails on a violation, and only there
    short.write_text("line\n" * MAX_BENCHMARK_PAGE_LINES)
    log.write_text("line\n" * (MAX_BENCHMARK_PAGE_LINES + 1))
    assert long_pages((short, log), MAX_BENCHMARK_PAGE_LINES) == {"log.md": MAX_BENCHMARK_PAGE_LINES + 1}


def test_every_relative_link_reaches_a_file(tmp_path):
    assert len(PAGES) > 1 and all(relative_links(page.read_text()) for page in PAGES), "pages without links?"
    assert {page.name: broken_links(page) for page in PAGES} == {page.name: [] for page in PAGES}

    (tmp_path / "docs").mkdir()  # the rule fails on a violation, and only there
    (tmp_path / "docs" / "there.md").write_text("# There\n")
    planted = tmp_path / "README.md"
    planted.write_text(
        "[ok](docs/there.md#there) ![gone](docs/gone.png) [web](https://example.com/x) [here](#top)\n"
        "[gone too](docs/missing.md#part) `[code](docs/code.md)`\n\n```\n[block](docs/block.md)\n```\n"
    )
    assert broken_links(planted) == ["docs/gone.png", "docs/missing.md#part"]


def test_the_readme_commands_are_the_ones_ci_runs():
    readme, ci_script = README.read_text(), CI.read_text()
    assert ci_mismatches(readme, ci_script) == []

    # the rule fails on a violation: CI's pytest run changed, its setup dropped, the serve command gone
    assert ci_mismatches(readme, ci_script.replace("-n 2 --dist loadgroup", "-n 4")) == [
        f"CI does not run `{PYTEST} -n 2 --dist loadgroup`"
    ]
    assert ci_mismatches(readme, ci_script.replace(TEST_SETUP, "bash scripts/setup.sh")) == [
        f"CI does not run `{TEST_SETUP}`"
    ]
    assert ci_mismatches(readme.replace(SERVE, "wsgi-infer serve"), ci_script) == [f"the README has no `{SERVE}`"]
