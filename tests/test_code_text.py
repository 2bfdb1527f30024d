"""The package's comments and docstrings state design and invariants, not measurements (STYLE.md,
habit 21): milliseconds, GB/s or the GPU they ran on go stale with the next tuning. Every comment
(tokenize) and docstring (ast) under pdserve/ is scanned for a number with a unit of time or rate
and for a GPU's name; a hit fails, named file:line.

Where a figure goes instead: docs/results.md, "Figures behind the code's choices", or the docs page
of its subsystem, beside the command and the machine that measured it; the code says the design
and points there. A constant that is itself a measurement (a codec rate, a profile) stays in the
code as data, with one line naming its benchmark command and its docs section. Strings that are
not docstrings (help texts, log messages, metric descriptions, report headers) are not scanned.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pdserve"

# A number followed by a unit of time or rate ("1.8 ms", "0.4-0.6 GB/s", "9-15 us"), or a GPU's name.
FIGURE = re.compile(
    r"(?<![\w.])\d+(?:[.,]\d+)*\s?(?:ms|us|µs|GB/s|TB/s|MB/s|Gbit/s|Tbit/s|Mbit/s|Gbps|tok/s)(?![\w/])"
    r"|\b(?:A100|H100|H200|B200)s?\b"
)

# Lines where a number with a unit is design, not a measurement: (file, a fragment of the line) -> why.
ALLOWED = {
    ("pdserve/kvtransfer/pacing_spec.py", "through one 10 Gbit/s link"):
        "an example of the option's syntax: the rate is what the user writes",
    ("pdserve/launcher/emulation/__init__.py", "at 1-100 Gbit/s"):
        "the range of link rates the emulation is built to hold (the design's scope)",
    ("pdserve/router/placement/profiles.py", '"name": "NVIDIA H100 80GB HBM3"'):
        "an example of the profile file's hardware field (what `pdserve profile` writes)",
}

# Being split in parallel; remove after merge. Their figures move to docs/ in those branches.
EXCLUDED = {
    "pdserve/kvtransfer/ucx_runtime.py",
    "pdserve/tokenizer.py",
}


def text_lines(source: str) -> list[tuple[int, str]]:
    """(line number, source line) of every comment and every line of every docstring in `source`."""
    lines = source.splitlines()
    found: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            for n in range(first.value.lineno, first.value.end_lineno + 1):
                found[n] = lines[n - 1]
    return sorted(found.items())


def figures(source: str) -> list[tuple[int, str]]:
    """(line number, line) of each comment or docstring line of `source` that quotes a figure."""
    return [(n, line.strip()) for n, line in text_lines(source) if FIGURE.search(line)]


@functools.lru_cache(maxsize=1)
def _package_hits() -> tuple[tuple[str, ...], frozenset[tuple[str, str]]]:
    hits, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXCLUDED:
            continue
        for n, line in figures(path.read_text(encoding="utf-8")):
            allowed = [key for key in ALLOWED if key[0] == rel and key[1] in line]
            if allowed:
                used.update(allowed)
            else:
                hits.append(f"{rel}:{n}: {line}")
    return tuple(hits), frozenset(used)


def test_comments_and_docstrings_quote_no_measured_figures():
    hits, _ = _package_hits()
    assert not hits, ("measured figures in comments or docstrings; move them to docs/ (docs/results.md, "
                      "\"Figures behind the code's choices\") and say the design here:\n" + "\n".join(hits))


def test_every_allowlist_entry_is_still_needed():
    _, used = _package_hits()
    assert set(ALLOWED) - used == set(), "allowlist entries that match no line any more: remove them"


def test_a_planted_figure_is_caught_where_it_is():
    source = textwrap.dedent('''\
        """A module. Its rule holds for any rate."""

        LIMIT = 4  # programs per SM

        def f():
            """Fast enough: 1.8 ms a layer on one H200."""
            # gathers at 152 GB/s
            return "took 3.2 ms"  # a log message's figure is not the code's text
        ''')
    assert figures(source) == [(6, '"""Fast enough: 1.8 ms a layer on one H200."""'), (7, "# gathers at 152 GB/s")]


def test_units_and_names_the_pattern_takes():
    for text in ("0.4-0.6 GB/s", "9-15 us", "2,048 tok/s", "at 25 Gbit/s", "1 TB/s", "two H200s", "an H100"):
        assert FIGURE.search(text), text
    for text in ("rate_gbps", "16s", "10 s window", "x 70.6/8.03/4", "`llama8b_h100()`", "v2 msg"):
        assert not FIGURE.search(text), text
