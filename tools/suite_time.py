"""Where the test suite spends its time: per-test seconds from a pytest junit file, summed by test and file.

    python -m pytest -q --junitxml=run.xml [-m EXPR]                 # any run, with or without -n
    python tools/suite_time.py run.xml [--marker-expr EXPR] [--top 25]

Prints the number of tests and their summed seconds (setup + call + teardown, as pytest's junit ``time``; with
``-n 2`` two tests run at once, so the sum is about twice the wall clock), how much the tests over 1, 2, 3, 5,
10 and 30 s hold, the ``--top`` slowest tests and the slowest files. ``--marker-expr`` keeps only the tests that
``pytest --collect-only -m EXPR`` selects (e.g. ``'not slow and not container'``: the edit loop), read
from this checkout. Node ids are rebuilt from junit's ``classname`` (``tests.unit.x.test_y.TestZ``) and ``name``.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def node_id(classname: str, name: str) -> str:
    """``tests.unit.x.test_y.TestZ`` + ``test_a[p]`` -> ``tests/unit/x/test_y.py::TestZ::test_a[p]``."""
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        if parts[k - 1].startswith("test_"):
            return "/".join(parts[:k]) + ".py::" + "::".join([*parts[k:], name])
    return f"{classname}::{name}"


def read_junit(path: str) -> list[tuple[float, str]]:
    """``[(seconds, node id)]`` of every test case in a junit file (skipped ones included, with their time)."""
    root = ET.parse(path).getroot()
    return [(float(tc.get("time") or 0.0), node_id(tc.get("classname", ""), tc.get("name", "")))
            for tc in root.iter("testcase")]


def selected_ids(expr: str) -> set[str]:
    """Node ids ``pytest --collect-only -m expr`` selects in this checkout."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                          "-m", expr], cwd=REPO, capture_output=True, text=True, check=False).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", help="junit XML file written by pytest --junitxml")
    p.add_argument("--marker-expr", default="", help="keep only the tests pytest -m EXPR selects here")
    p.add_argument("--top", type=int, default=25, help="how many of the slowest tests and files to print")
    args = p.parse_args(argv)
    try:
        rows = read_junit(args.junit)
    except (OSError, ET.ParseError) as e:
        p.error(f"{args.junit} is not a readable junit XML file ({e}); write one with pytest --junitxml=FILE")
    if args.marker_expr:
        keep = selected_ids(args.marker_expr)
        rows = [r for r in rows if r[1] in keep]
        print(f"-m {args.marker_expr!r}: {len(keep)} tests collected here, {len(rows)} of them in the junit file")
    rows.sort(reverse=True)
    total = sum(t for t, _ in rows)
    print(f"{len(rows)} tests, {total:.0f} s summed (with -n 2 two tests run at once: about twice the wall clock)")
    for limit in (30, 10, 5, 3, 2, 1):
        over = [t for t, _ in rows if t > limit]
        print(f"  over {limit:>2} s: {len(over):4d} tests, {sum(over):6.0f} s; the rest {total - sum(over):6.0f} s")
    print(f"the {min(args.top, len(rows))} slowest tests:")
    for t, nid in rows[:args.top]:
        print(f"{t:8.1f}  {nid}")
    files = collections.Counter()
    for t, nid in rows:
        files[nid.split("::")[0]] += t
    print(f"the {min(args.top, len(files))} slowest files:")
    for f, t in files.most_common(args.top):
        print(f"{t:8.1f}  {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
